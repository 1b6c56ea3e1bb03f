"""Devices beyond this process. transport.mpi (imported only under mpiexec, with mpi4py) serves
the devices of other MPI ranks behind the Device messages.

Whether this process is one rank of a larger MPI job is read from the environment that the
usual launchers set (MPICH's and Intel MPI's PMI_SIZE and PMI_RANK, Open MPI's
OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK), so that a one-process run never imports mpi4py.
"""

from __future__ import annotations

import os
import select
import time

# seconds a rank may take to answer one request (its compute included), and MPI's start-up
DEFAULT_TIMEOUT = 300.0
ABORT_WAIT_S = 5.0   # for the launcher to end this rank, after asking it to end the job

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def launched_size() -> int:
    """The number of ranks the launcher started (1 outside mpiexec)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 outside mpiexec)."""
    for var in _RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def end_job_unstarted(status: int) -> bool:
    """From a rank that failed before MPI started in it (no MPI_Abort to call), ask the launcher
    to end every rank with `status`, rather than leave them waiting in MPI's start-up until
    --timeout. MPICH's Hydra gives each rank a socket of the PMI-1 wire protocol (PMI_FD),
    whose abort ends the job at once. False where there is none (another launcher) or it does
    not answer within a few seconds."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return False
    fd = int(fd)
    try:
        os.write(fd, b"cmd=init pmi_version=1 pmi_subversion=1\n")
        reply, deadline = b"", time.monotonic() + 5
        while not reply.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            more = os.read(fd, 256)
            if not more:
                return False
            reply += more
        if b"cmd=response_to_init" not in reply or b"rc=0" not in reply.split():
            return False
        time.sleep(0.3)   # the launcher forwards what this rank wrote before it ends the job
        os.write(fd, f"cmd=abort exitcode={int(status)}\n".encode())
    except (OSError, ValueError):
        return False
    time.sleep(ABORT_WAIT_S)   # the launcher ends this rank too
    return True
