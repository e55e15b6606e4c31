"""Who moves a job's bytes between a worker's KV cache and the host pool.

base.py is the interface every transport implements; shared_memory.py is the
transport of CPU engines (the worker copies), cuda.py the one of GPU engines
(the daemon copies on its own streams). The depot above them is the same code
whichever moves the bytes.
"""
