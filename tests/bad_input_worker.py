"""Run commands as `python -m MODULE ARGS...` would, one after another in this process, and report each one's exit
code and everything it wrote to file descriptor 2 (Python's and C libraries' stderr alike).

    python bad_input_worker.py CASES.json OUT.json     # CASES: {name: [module, arg, ...]}

Used by tests/test_cli_errors.py: one process pays the imports (JAX, Orbax, transformers) once for every case.
"""
import json
import os
import runpy
import sys
import tempfile
import traceback


def run(module: str, args: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `python -m module *args`; an exception that escapes is printed as Python would."""
    with tempfile.TemporaryFile("w+") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as the interpreter would, then judged by the test
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        return code, log.read()


if __name__ == "__main__":
    cases_path, out_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    results = {name: run(cmd[0], cmd[1:]) for name, cmd in cases.items()}
    with open(out_path, "w") as f:
        json.dump(results, f)
