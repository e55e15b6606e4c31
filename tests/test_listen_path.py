"""A mistyped --listen never costs anyone a file: the daemon removes only
sockets (a crashed daemon's) from where it listens."""

from __future__ import annotations


def test_listen_at_a_regular_file_refuses_to_start_and_leaves_it(start_daemon, tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("not a socket\n")
    daemon = start_daemon(listen=str(precious), wait=False)
    assert daemon.proc.wait(30) == 1
    assert f"{precious} exists and is not a socket: refusing to replace it" in daemon.log()
    assert precious.read_text() == "not a socket\n"


def test_a_regular_file_where_the_job_socket_goes_refuses_to_start_and_is_left(start_daemon, tmp_path):
    """Clients prove who they are on the job socket, so the daemon cannot serve without it."""
    folder = tmp_path / "d"
    folder.mkdir()
    precious = folder / "kvdepot.sock.jobs"
    precious.write_text("not a socket either\n")
    daemon = start_daemon(folder=folder, wait=False)
    assert daemon.proc.wait(30) == 1
    assert "cannot serve the job socket" in daemon.log() and "is not a socket" in daemon.log()
    assert precious.read_text() == "not a socket either\n"
