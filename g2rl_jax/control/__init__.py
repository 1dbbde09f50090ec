"""Run control: what keeps an unattended run safe to leave alone. Where things live:

  exits.py    the exit codes of every process and what a supervisor does with each (stdlib only; the one table)
  errors.py   the failures a run stops for, each raised where it happens (StorageUnavailable, LeaseLost,
              DeviceOutOfMemory, RewardFunctionFailed, PeerLost, BadInput) with its code and one line; `end_run` ends
              every process with it; `device_failure` classifies a program's or a host collective's runtime error;
              `exit_code` maps whatever ends the trainer to its code
  holder.py   who holds a lease: host, boot id, PID namespace, pid, start time; whether that process is gone
  lease.py    the lease itself: its holder's renewals and clock (writes stop a margin before anyone may take it
              over), a watcher's view, a follower's (the other processes write under process 0's lease); `KeyLease`,
              the rollout processes' liveness in the key-value store
  runlock.py  the run lock: `<run>/run.lock` as a lease, its takeover rules, its lost and unreachable lines
  fence.py    the fence every change of run state passes: the lease held, or nothing is written
  fence_proxy.py  tensorstore's requests through the fence: a loopback forwarder that sends them on while held
  commits.py  Orbax's commits and deletes behind the fence, its failure logs, a restore's failure told apart
  oom.py      the planner's hint when a device runs out of memory
  channel.py  the one key-value channel between a run's processes (jax.distributed's store): chunks, bounded gets
  wire.py     values that cross a process or a file: JSON plus arrays, checked when read, never pickle
  stop.py     the one stop path: publish "stop with code C and line L", watch for it, the trainer's end

The states a run goes through (every process; process 0 holds the lease, the other trainer processes follow it, and
the fence guards the writes of each):

    start ──► checks ──bad input──────────────────────────────────────────────────────────► exit 2
                 │ (config, data, paths; a store that does not answer the start's check: exit 75)
                 ▼
            take the lease ──held by a live trainer (it renewed while we watched)──────────► exit 2
                 │ (create it; or, once stale: gone on this machine, our own, or unchanged
                 │  for a whole lease past the last change seen, replace it conditionally)
                 ▼
            restore the newest readable checkpoint (a corrupt one set aside) ──store down──► exit 75
                 ▼
     ┌──► train a step ──► checkpoint (commit fenced) ──► record, validate ──► next step
     │       │                                                           │
     │       ├─ the store did not serve a request ─────────── StorageUnavailable ──────────► exit 75
     │       ├─ a program ran out of device memory ─────────── DeviceOutOfMemory (+hint) ──► exit 4
     │       ├─ reward.function raised on a row ────────────── RewardFunctionFailed ───────► exit 5
     │       ├─ a peer process vanished from a collective ──── PeerLost ───────────────────► exit 76
     │       ├─ a value this version did not write (a pickle) ── BadInput (wire.Refused) ──► exit 2
     │       ├─ SIGTERM ── finish the step and save, or abandon it (the grace) ────────────► exit 143
     │       └─ anything else: a bug, its traceback ───────────────────────────────────────► exit 1
     │
     │   meanwhile the lease thread renews every lease/3 (a follower reads the lock 8 times a lease):
     │       renewed (or found our own record) ── writable until send + lease - margin
     │       (a follower: a newer version seen ── writable until the earlier read's send + lease - margin)
     │       another's record, or none ─────────────────────── LeaseLost ──────────────────► exit 3
     │       nothing confirmed for a whole lease ───────────── LeaseLost (the store's code) ► exit 75
     └─── total_steps reached: summary, release the lease ─────────────────────────────────► exit 0

Every failure path closes the fence first (nothing more is written), then prints its one line and ends every
process of the run with its code (control/stop.py), and in a notebook the failure is raised in the main
thread instead, and the kernel lives.
"""
