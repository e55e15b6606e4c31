"""kvdepot: a per-node KV-cache offload daemon for LLM inference engines."""

import os as _os

__version__ = "0.1.0"

# In a source checkout the subpackages live in the top-level folders proto/,
# server/ and client/ (an installed wheel has them under kvdepot/). Extending
# the package path lets `PYTHONPATH=<checkout>` work without an install, which
# is how the GPU machines, which have no package registry, run the project.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_checkout, "proto", "kvdepot.proto")
):
    __path__.append(_checkout)  # noqa: F821 - __path__ is set for packages
