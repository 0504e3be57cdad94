"""The engine core and the boundary around it: where it runs and how the front end talks to it.

- ``engine_core``: ``EngineCore``, the scheduler plus an executor, one step at a time.
- ``core_proc``: ``EngineCoreProc``, the core's loop (apply commands, step while there is work, report each
  step), and the wire protocol it speaks; the entry point of a child process.
- ``core_client``: ``CoreClient``, the front end's one interface to a core wherever it runs; ``CorePlacement``
  (``INLINE``, ``THREAD``, ``CHILD_PROCESS``, ``RAY_ACTOR``).
- ``make_client``: ``make_core_client``, the one way to start a core and get its client.
- ``inproc_client``: the clients of a core in this process (``INLINE``: the caller turns its loop; ``THREAD``).
- ``proc_client``: ``ProcCoreClient``, the client of a core in another process (``CHILD_PROCESS``, ``RAY_ACTOR``).
- ``core_hosts``: ``CoreHost``, what such a core runs in (a child process, or ``cluster.core_actor`` by
  import path), started by placement.
"""
