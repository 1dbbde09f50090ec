"""The gcsfs client every file the project writes itself goes through (g2rl_jax/storage_clients.py's `configure`
registers it for gs:// and gcs://): each update of an object paced to one a second (a 429 avoided, not retried);
each request retried by gcsfs's own retry loop in storage_clients.gcsfs_attempts() attempts; each update attempt let
out only through the fence (control/fence.py: this process holds the run's lease); a failure the caller gets typed
where the request failed (`_typed`: StorageUnavailable when the store did not serve it, PermissionError for a 403),
and gcsfs's log records of such a failure kept to one line (the caller reports it).
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.parse


def _body_bytes(kwargs: dict) -> bytes:
    data = kwargs.get("data")
    if kwargs.get("json") is not None:
        return json.dumps(kwargs["json"]).encode()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data[:65536])
    if hasattr(data, "getvalue"):
        return bytes(data.getvalue()[:65536])
    return b""


def _unavailable(err: BaseException) -> bool:
    """Whether `err`, raised by a gcsfs request once its retries were spent (or by one not retried), says the store
    did not serve it: a connection refused, dropped or timed out, an answer 408, 429 or 5xx, a token refresh that
    could not reach its server. Not: a missing object (404), a failed precondition (412), a refusal (401, 403)."""
    import aiohttp
    import google.auth.exceptions
    import requests
    from gcsfs.retry import HttpError, errs

    if isinstance(err, HttpError):
        return err.code in errs
    return isinstance(err, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError,
                            requests.exceptions.RequestException, google.auth.exceptions.TransportError))


def _typed(err: BaseException, url: str, verb: str) -> BaseException:
    """The error a caller gets for a failed gcsfs request: StorageUnavailable (the store did not serve it, with the
    last status), PermissionError for a 403 (gcsfs raises a plain OSError for it, and for nothing else it lets
    through), else `err` itself."""
    from g2rl_jax.control.errors import StorageUnavailable

    if _unavailable(err):
        return StorageUnavailable(url, err, verb=verb, status=getattr(err, "code", None))
    if type(err) is OSError:
        return PermissionError(f"{url}: {err}")
    return err


def register() -> None:
    """gs:// and gcs:// served by a gcsfs filesystem that paces its own updates of one object to one a second
    (every file written through gcsfs, Orbax's metadata files included; see the module docstring), once per
    process."""
    import fsspec
    from gcsfs.retry import HttpError, retry_request

    from g2rl_jax import storage_append, storage_clients
    from g2rl_jax.control import errors, fence

    base = fsspec.get_filesystem_class("gs")
    if getattr(base, "paced", False):
        return
    uploads: dict[str, str] = {}
    undecorated = getattr(base._request, "__wrapped__", None)  # gcsfs's _request without its 6-attempt retry

    async def attempt(fs, method, path, *args, fenced=None, condition=None, **kwargs):
        if fenced is not None:  # every attempt: a retry after a freeze goes out only if the lease is still held
            await fence.check_async(fenced)
        if undecorated is None:  # another gcsfs: its own 6 attempts, fenced once
            return await base._request(fs, method, path, *args, **kwargs)
        try:
            return await undecorated(fs, method, path, *args, **kwargs)
        except HttpError as err:
            if condition is not None and err.code in (429, "429") and await _precondition_fails(fs, *condition):
                raise FileExistsError(f"{fenced}: changed by another writer while this write was throttled") from err
            raise

    async def _precondition_fails(fs, bucket: str, name: str, expected: str) -> bool:
        """After a conditional update drew a 429 (another writer's update of the object is in flight or just landed):
        whether its ifGenerationMatch=`expected` would fail now ('0': the object exists), so that it ends as the 412
        it would meet, instead of a retry that contends for the object's one update a second again. A look that fails
        decides nothing: the 429 is retried."""
        try:
            meta = json.loads((await undecorated(fs, "GET", "b/{}/o/{}", bucket, name))[3])
        except FileNotFoundError:
            return expected != "0"
        except Exception:  # noqa: BLE001 - no answer: the throttled write is retried as it would have been
            return False
        return str(meta.get("generation")) != str(expected)

    request = retry_request(retries=storage_clients.gcsfs_attempts())(attempt) if undecorated is not None else attempt

    class PacedGCSFileSystem(base):
        paced = True

        async def _request(self, method, path, *args, **kwargs):
            url = urllib.parse.urlsplit(self._format_path(path, args))
            query = {k: str(v) for k, v in self._get_params(
                {k: v for k, v in kwargs.items() if k not in ("headers", "json", "data", "cache_type",
                                                               "cache_source")}).items()}
            query |= {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
            kind, obj = storage_clients.classify(method, url.path, query, _body_bytes(kwargs), uploads)
            target = f"gs://{obj}" if obj else f"gs:/{url.path}"
            updates = obj is not None and kind in (*storage_clients.UPDATES, "start")
            try:
                if not updates:
                    return await request(self, method, path, *args, **kwargs)
                wait = storage_append.UPDATE_INTERVAL_S + 0.05 - storage_append._since_update(target)
                if wait > 0 and "upload_id" not in query:  # a resumable upload waits at its start
                    await asyncio.sleep(wait)
                expected = query.get("ifGenerationMatch")
                condition = tuple(obj.split("/", 1)) + (expected,) if expected is not None else None
                result = await request(self, method, path, *args, fenced=target, condition=condition, **kwargs)
            except Exception as err:  # noqa: BLE001 - typed for the caller (`_typed`), or re-raised as it is
                typed = _typed(err, target, "write" if updates else "read")
                if typed is err:
                    raise
                raise typed from err
            status, headers = result[0], result[1]
            if kind == "start" and "upload_id=" in headers.get("Location", ""):
                uploads[urllib.parse.parse_qs(urllib.parse.urlsplit(headers["Location"]).query)["upload_id"][0]] = obj
            elif status < 300:
                with storage_append._UPDATED_LOCK:
                    storage_append._UPDATED[target] = time.monotonic()
            return result

        async def _get_file_request(self, rpath, lpath, *args, **kwargs):  # a download to a local file
            try:
                return await super()._get_file_request(rpath, lpath, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - typed for the caller, or re-raised as it is
                typed = _typed(err, str(rpath), "read")
                if typed is err:
                    raise
                raise typed from err

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, PacedGCSFileSystem, clobber=True)
    # gcsfs's retry loop logs a request that failed ("out of retries", "non-retriable exception"): its caller gets it
    # typed (StorageUnavailable, FileExistsError for a failed precondition, ...) and reports it
    errors.one_line_records("gcsfs", "a failed request", lambda record: record.module == "retry")
