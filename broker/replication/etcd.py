"""A small client for etcd's v3 API through its JSON gateway (etcd 3.4: ``/v3/...``), on aiohttp.

Only what leadership needs: leases (grant, keep-alive, revoke), get / prefix get, put,
delete, and the one transaction "create this key if it does not exist". Consensus is
etcd's; this module only speaks its documented HTTP API.
"""
from __future__ import annotations

import base64
from typing import Any, NamedTuple

import aiohttp


class EtcdError(Exception):
    """etcd answered with an error, or could not be reached in time."""


class KeyValue(NamedTuple):
    key: str
    value: bytes
    create_revision: int
    lease: int


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


class EtcdClient:
    def __init__(self, endpoint: str, timeout: float = 1.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        if "://" not in self.endpoint:
            self.endpoint = "http://" + self.endpoint
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            async with self._session.post(self.endpoint + path, json=body) as resp:
                data: dict[str, Any] = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise EtcdError(f"etcd {self.endpoint}{path}: {exc or type(exc).__name__}") from None
        if "error" in data and "header" not in data and "result" not in data:
            raise EtcdError(f"etcd {path}: {data.get('message') or data['error']}")
        return data

    async def grant(self, ttl: int) -> tuple[int, int]:
        data = await self._call("/v3/lease/grant", {"TTL": ttl})
        return int(data["ID"]), int(data["TTL"])

    async def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL in seconds; 0 when the lease is gone."""
        data = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    async def get(self, key: str) -> KeyValue | None:
        found = await self.get_prefix(key, exact=True)
        return found[0] if found else None

    async def get_prefix(self, prefix: str, exact: bool = False) -> list[KeyValue]:
        body = {"key": _b64(prefix)}
        if not exact:
            body["range_end"] = _prefix_end(prefix)
        data = await self._call("/v3/kv/range", body)
        return [KeyValue(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
                         int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))
                for kv in data.get("kvs", [])]

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self._call("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def create(self, key: str, value: bytes, lease: int) -> int | None:
        """Put ``key`` only if it does not exist; the revision that created it, or None."""
        data = await self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
        })
        if not data.get("succeeded"):
            return None
        return int(data["header"]["revision"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
