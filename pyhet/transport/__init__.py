"""Devices beyond this process. transport.mpi (imported only under mpiexec, with mpi4py) serves
the devices of other MPI ranks behind the Device messages.

Whether this process is one rank of a larger MPI job is read from the environment that the
usual launchers set (MPICH's and Intel MPI's PMI_SIZE and PMI_RANK, Open MPI's
OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK), so that a one-process run never imports mpi4py.
"""

from __future__ import annotations

import os

# seconds a rank may take to answer one request (its compute included), and MPI's start-up
DEFAULT_TIMEOUT = 300.0

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
