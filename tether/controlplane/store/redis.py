"""The shared store: one Redis that several control plane replicas use at once (``redis://HOST:PORT/DB``).

Every multi-key write is one Lua script, so it is atomic against every replica: a link and its jti index,
an event and its sequence number, a CAS on a document, a record and the chain head, a lease. Reads that
need two keys at once run in MULTI. Keys live under ``tether:<db>:`` (pub/sub channels are not per
database, so the database number is part of the names).

The event log is a sorted set scored by a sequence from INCR; the script that appends also trims it to the
last ``EVENT_RETENTION`` events and PUBLISHes the new sequence. The publication is only a wake-up for
long polls on every replica (pub/sub is not durable); what a sidecar receives is always read back from the
sorted set by sequence, and because sequence and entry are written in one script, no reader ever sees
seq N+1 without N.

A record is a header in the chain's list and a list of its call entries of its own, staged before the
header is appended; an index of the log (who holds each call) is filled oldest record first (see
"records" below). No command's cost grows with a record: every read and write of one is a page.

Leases are decided on the ``now`` the caller passes, exactly like SQLite, so both stores agree under a
test clock; the Redis key also carries a real-time expiry one minute past the lease, only so that leases
of dead replicas do not pile up. Replicas must therefore have synchronised clocks (NTP): each compares its
clock with Redis ``TIME`` (``reference_time``) and takes no lease while it is off by more than the bound
(``tether/controlplane/clock.py``).

Availability: ``open()`` does not fail when Redis is unreachable. A replica may start before Redis
(compose, Kubernetes); until Redis answers, every store call raises ``StoreUnavailable`` (the API answers
503 ``tether.store_unavailable``), ``healthy()`` is False (``/healthz`` answers 503), and the wake-up
listener keeps reconnecting. A malformed URL still fails at once. A command is retried once after a
connection error (a pooled connection is stale after a Redis restart); a write whose reply was lost may
then run twice, which every caller tolerates: links, revocations and reports are idempotent, and a CAS or
record append that finds its own earlier write answers False, so the caller re-reads.

A Redis that answers but refuses writes (OOM under ``noeviction``, MISCONF after a failed save, NOREPLICAS,
a read-only replica) raises ``StoreUnwritable``: the API answers 503 ``tether.store_unwritable`` and
``/healthz`` says so (``tether/controlplane/store/health.py``). Redis refuses a script at its first write, so a
refused script has written nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from tether.capability import jsonpieces
from tether.capability.budget import MAX_SLICE
from tether.capability.errors import BAD_REQUEST, TetherError

from ..termination import encode_entry, entry_text
from .base import Doc, Event, Holders, LinkConflict, StagedPage, Store, Stored, StoreUnavailable, StoreUnwritable

log = logging.getLogger("tether.store.redis")

EVENT_RETENTION = 10_000
LEASE_GC_SLACK_MS = 60_000
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 5.0
POOL_SIZE = 64
_UNAVAILABLE = (rex.ConnectionError, rex.TimeoutError, rex.MasterDownError, OSError)
# Redis answers but refuses writes: past maxmemory under noeviction (OOM), after a failed background save with
# stop-writes-on-bgsave-error (MISCONF), short of min-replicas-to-write (NOREPLICAS), or a read-only replica.
_REFUSING = ("OOM", "MISCONF", "NOREPLICAS", "READONLY")


def _write_refusal(exc: Exception) -> bool:
    if isinstance(exc, (rex.OutOfMemoryError, rex.ReadOnlyError)):
        return True
    return isinstance(exc, rex.ResponseError) and str(exc).split(" ", 1)[0] in _REFUSING


def _start_field(doc: Doc) -> str:
    """A start is the agent's own: keyed by agent and call id, so no other agent's report can make it moot."""
    return f"{doc['agent']}/{doc['call_id']}"


def _dump(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


class _Cursor:
    """Where a read of one agent's index by start stands: the last (score, member) taken, how many members
    at that score were read, and what was read and not yet taken."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.score: float | None = None
        self.at_score = 0
        self.last: tuple[float, str] | None = None
        self.buffer: list[tuple[float, str]] = []
        self.done = False

    def refill(self, rows: list[tuple[float, str]], asked: int) -> None:
        self.done = len(rows) < asked
        fresh = [row for row in rows if self.last is None or row > self.last]  # never a member twice
        for score, _ in rows:
            if score == self.score:
                self.at_score += 1
            else:
                self.score, self.at_score = score, 1
        self.buffer = fresh  # empty when a tie group shifted under us: only members taken before were read

    def take(self, n: int) -> list[str]:
        rows, self.buffer = self.buffer[:n], self.buffer[n:]
        self.last = rows[-1]
        return [member for _, member in rows]


class _Staging:
    """One page of ``stage_reports`` gathered from the staging scripts' replies (``_STAGE_BODY``)."""

    def __init__(self) -> None:
        self.staged: list[str] = []
        self.texts: list[str] = []
        self.holders: dict[str, Holders] = {}
        self.read = 0

    def add(self, reply: list[Any]) -> None:
        self.staged += reply[1]
        flat = reply[2]
        self.holders.update({flat[i]: (flat[i + 1] or None, tuple(flat[i + 2].split()))
                             for i in range(0, len(flat), 3)})
        self.texts += reply[3]

    def page(self) -> StagedPage:
        return StagedPage(list(zip(self.staged, self.texts, strict=True)), self.holders)


def _holder_args(texts: list[str]) -> list[str]:
    """(call_id, '1' | '0') for each call entry: reported, or listed unknown."""
    out: list[str] = []
    for text in texts:
        entry = json.loads(text)
        out += [entry["call_id"], "0" if entry.get("reported", True) is False else "1"]
    return out


def _guarded[**P, R](method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Turn "Redis cannot be reached" into StoreUnavailable; other Redis errors are bugs and propagate."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store: RedisStore = args[0]  # type: ignore[assignment]
        try:
            return await method(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Redis at {store.url} is unreachable: {exc}") from exc
        except rex.ResponseError as exc:
            if not _write_refusal(exc):
                raise
            reason = f"Redis at {store.url} refuses writes: {_refusal_text(exc)}"
            store.write_failed(reason)
            raise StoreUnwritable(reason) from exc

    return wrapper


def _writes[**P, R](method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """A write method (inside ``_guarded``, which reports refusals): a success goes to the write health."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        result = await method(*args, **kwargs)
        args[0].write_succeeded()  # type: ignore[attr-defined]
        return result

    return wrapper


def _refusal_text(exc: Exception) -> str:
    """Redis's own words; redis-py drops the OOM prefix it turned into the exception's type."""
    text = str(exc)
    if isinstance(exc, rex.OutOfMemoryError) and not text.startswith("OOM"):
        text = "OOM " + text
    return text


# KEYS: links, jti index, insertion order, then per link its parent's children (the descendants index: a
# hash of child link -> agent) and the list of its subject's links. ARGV: (hash, jti, doc, agent) per link.
# A link whose hash is already known is left as it was. Returns {new} or, when a jti already names another
# link (stored or earlier in the batch), {-1, jti, that link's hash} having stored nothing.
_PUT_LINKS = """
local batch = {}
for i = 1, #ARGV, 4 do
  local h, jti = ARGV[i], ARGV[i + 1]
  local owner = batch[jti] or redis.call('HGET', KEYS[2], jti)
  if owner and owner ~= h then
    return {-1, jti, owner}
  end
  batch[jti] = h
end
local new = 0
for i = 1, #ARGV, 4 do
  local h, jti = ARGV[i], ARGV[i + 1]
  if redis.call('HEXISTS', KEYS[1], h) == 0 then
    redis.call('HSET', KEYS[1], h, ARGV[i + 2])
    redis.call('HSET', KEYS[2], jti, h)
    redis.call('RPUSH', KEYS[3], h)
    redis.call('HSET', KEYS[2 + (i + 3) / 4 * 2], h, ARGV[i + 3])
    redis.call('RPUSH', KEYS[3 + (i + 3) / 4 * 2], h)
    new = new + 1
  end
end
return {new}
"""

# KEYS: events, sequence. ARGV: entry, retention, channel. Returns the new sequence number.
_APPEND_EVENT = """
local seq = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], seq, seq .. ':' .. ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', seq - tonumber(ARGV[2]))
redis.call('PUBLISH', ARGV[3], seq)
return seq
"""

# KEYS: reports, order, counter, entries, links, then per report its agent's two indexes (by arrival; by start,
# for a record's order: equal scores sort by member, i.e. by call id). ARGV: (call_id, doc, start, entry, link)
# per report: its entry text in a record (``termination.entry_text``) and its link ('-' for none) are kept apart
# from the report, so a record is staged without decoding one.
_PUT_REPORTS = """
local new = {}
for i = 1, #ARGV, 5 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    local n = redis.call('INCR', KEYS[3])
    local k = (i + 4) / 5
    redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 3])
    redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 4])
    redis.call('ZADD', KEYS[2], n, ARGV[i])
    redis.call('ZADD', KEYS[4 + 2 * k], n, ARGV[i])
    redis.call('ZADD', KEYS[5 + 2 * k], ARGV[i + 2], ARGV[i])
    new[#new + 1] = ARGV[i]
  end
end
return new
"""

# The body both staging scripts share. KEYS: links of reports, owner index, unknown index, the record's staged
# calls and their ids, the entry texts kept beside the reports. ARGV: staged TTL (ms), the number of links, the
# links; ``ids``: call ids in the record's order. Each call under one of the links (or none) that no record
# holds as reported is appended to the record's calls as '' (its text is the one kept beside its report) and
# its id to their ids. Only ids, short values and the entry texts pass through the script. Returns {1, staged
# ids, holders (call id, owner or '', unknown records or '') of every call a record lists, the staged calls'
# entry texts (to be hashed: no second command for them)}, or {0, ids without a kept link} having written
# nothing (reports stored before they were kept: the caller adds theirs and asks again).
_STAGE_BODY = """
local nlinks = tonumber(ARGV[2])
local allowed = {}
for i = 3, 2 + nlinks do allowed[ARGV[i]] = true end
if #ids == 0 then return {1, {}, {}, {}} end
local links = redis.call('HMGET', KEYS[1], unpack(ids))
local missing = {}
for j, v in ipairs(links) do
  if not v then missing[#missing + 1] = ids[j] end
end
if #missing > 0 then return {0, missing} end
local owners = redis.call('HMGET', KEYS[2], unpack(ids))
local unknowns = redis.call('HMGET', KEYS[3], unpack(ids))
local staged, refs, marks, holders = {}, {}, {}, {}
for j, link in ipairs(links) do
  if link == '-' or allowed[link] then
    local cid, owner, unknown = ids[j], owners[j], unknowns[j]
    if owner or unknown then
      holders[#holders + 1] = cid
      holders[#holders + 1] = owner or ''
      holders[#holders + 1] = unknown or ''
    end
    if not owner then
      staged[#staged + 1] = cid
      refs[#refs + 1] = ''
      marks[#marks + 1] = '1 ' .. cid
    end
  end
end
local texts = {}
if #staged > 0 then
  texts = redis.call('HMGET', KEYS[6], unpack(staged))
  for j = 1, #staged do
    if not texts[j] then return redis.error_reply('tether: no entry text kept beside the report of ' .. staged[j]) end
  end
  redis.call('RPUSH', KEYS[4], unpack(refs))
  redis.call('RPUSH', KEYS[5], unpack(marks))
  redis.call('PEXPIRE', KEYS[4], ARGV[1])
  redis.call('PEXPIRE', KEYS[5], ARGV[1])
end
return {1, staged, holders, texts}
"""
# ARGV after the links: call ids in the record's order (several agents: merged by the caller).
_STAGE_REPORTS = """
local ids = {unpack(ARGV, 3 + tonumber(ARGV[2]), #ARGV)}
""" + _STAGE_BODY
# One agent: KEYS[7], its index by start; ARGV after the links: the last call id staged from it ('' for none)
# and how many to read. The ids are read inside Redis, after the last one's rank as of now (a report stored
# meanwhile is staged when it sorts after the point reached, and never twice), so no id crosses the wire
# towards Redis. Its reply ends with the last id read and how many were read (the body's reply, then these).
_STAGE_NEXT = """
local first = 3 + tonumber(ARGV[2])
local after, n = ARGV[first], tonumber(ARGV[first + 1])
local from = 0
if after ~= '' then
  local rank = redis.call('ZRANK', KEYS[7], after)
  if not rank then return redis.error_reply('tether: ' .. after .. ' left the index by start') end
  from = rank + 1
end
local ids = redis.call('ZRANGE', KEYS[7], from, from + n - 1)
local reply = (function()
""" + _STAGE_BODY + """
end)()
if reply[1] == 1 then
  reply[5] = ids[#ids] or ''
  reply[6] = #ids
end
return reply
"""
# KEYS: a sorted set. ARGV: lowest score, offset, count. ZRANGEBYSCORE ... WITHSCORES LIMIT, as a flat list.
_ZSLICE = """
return redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', ARGV[2], ARGV[3])
"""
STAGE_PART = 1000  # call ids per script: Redis, and every replica's requests, wait for 1,000 calls' staging at most

# KEYS: docs, versions, order, counter. ARGV: id, expected version ('' = unconditional), version, doc.
# The order is of last write, as in SQLite (INSERT OR REPLACE gives the row a new rowid).
_PUT_DOC = """
if ARGV[2] ~= '' then
  local current = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
  if current ~= tonumber(ARGV[2]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[4]), ARGV[1])
return 1
"""

# KEYS: records, head, the record's staged calls and their ids. ARGV: prev_hash, hash, header, how many calls
# are staged. One chain: append only on the current head; the staged calls stay (no longer expiring). -1: a count
# mismatch (a staging write that ran twice): nothing appended, the caller builds the record anew.
_APPEND_RECORD = """
local head = redis.call('GET', KEYS[2]) or ''
if head ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[4]) then return -1 end
redis.call('RPUSH', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PERSIST', KEYS[3])
redis.call('PERSIST', KEYS[4])
return 1
"""

# KEYS: owner index, unknown index. ARGV: record id, then (call_id, '1' reported | '0' unknown) per call.
# The first record to hold a call as reported keeps it (records are indexed oldest first); a call listed
# unknown gathers every record that listed it, space-separated.
_INDEX_CALLS = """
local rid = ARGV[1]
for i = 2, #ARGV, 2 do
  if ARGV[i + 1] == '1' then
    redis.call('HSETNX', KEYS[1], ARGV[i], rid)
  else
    local have = redis.call('HGET', KEYS[2], ARGV[i])
    if not have then
      redis.call('HSET', KEYS[2], ARGV[i], rid)
    elseif not string.find(' ' .. have .. ' ', ' ' .. rid .. ' ', 1, true) then
      redis.call('HSET', KEYS[2], ARGV[i], have .. ' ' .. rid)
    end
  end
end
return 1
"""

# KEYS: owner index, unknown index, a record's ids ('1 ID' | '0 ID'). ARGV: record id, first, last position.
# ``_INDEX_CALLS`` over a slice of the record's ids, read inside Redis. Returns how many ids it read.
_INDEX_LISTED = """
local rid = ARGV[1]
local listed = redis.call('LRANGE', KEYS[3], ARGV[2], ARGV[3])
for _, item in ipairs(listed) do
  local cid = string.sub(item, 3)
  if string.sub(item, 1, 1) == '1' then
    redis.call('HSETNX', KEYS[1], cid, rid)
  else
    local have = redis.call('HGET', KEYS[2], cid)
    if not have then
      redis.call('HSET', KEYS[2], cid, rid)
    elseif not string.find(' ' .. have .. ' ', ' ' .. rid .. ' ', 1, true) then
      redis.call('HSET', KEYS[2], cid, have .. ' ' .. rid)
    end
  end
end
return #listed
"""

# KEYS: indexed count. ARGV: expected, next. How many records (oldest first) are in the call index.
_ADVANCE = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

# KEYS: records, the record's calls. ARGV: position, the stored whole record, its header, then its entries.
# A record stored whole (before records were stored apart from their calls) becomes a header and its calls,
# once: another replica that converted it first leaves the element changed, and this does nothing.
_SPLIT_RECORD = """
if redis.call('LINDEX', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 500 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
redis.call('LSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
STAGED_TTL_MS = 24 * 3600 * 1000  # staged calls of a record whose writer died before appending it

# KEYS: lease. ARGV: owner, now, expires, gc_ms. Decided on the caller's clock, like SQLite.
_TRY_LEASE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
local expires = redis.call('HGET', KEYS[1], 'expires')
if owner and owner ~= ARGV[1] and tonumber(expires) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'expires', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""


# KEYS: slice, open slices, then one hash per counter. ARGV: want, fraction, max slice, ttl_ms, slice id, slice
# doc, then one limit per counter. All or nothing: the slice's size is decided on what is left of the tightest
# counter (tether/capability/budget.slice_size, mirrored here) and added to every counter's leased, in one step.
# Returns {granted, index of the tightest counter}; a slice already stored answers its own n (a retried call).
_TAKE_SLICE = """
local existing = redis.call('GET', KEYS[1])
if existing then return {tonumber(cjson.decode(existing)['n']), -1} end
local left, worst = nil, 0
for i = 3, #KEYS do
  local used = tonumber(redis.call('HGET', KEYS[i], 'used') or '0')
  local leased = tonumber(redis.call('HGET', KEYS[i], 'leased') or '0')
  local l = tonumber(ARGV[i + 4]) - used - leased
  if left == nil or l < left then left, worst = l, i - 3 end
end
if left == nil or left <= 0 then return {0, worst} end
local g = math.floor(left * tonumber(ARGV[2]))
if g > tonumber(ARGV[1]) then g = tonumber(ARGV[1]) end
if g > tonumber(ARGV[3]) then g = tonumber(ARGV[3]) end
if g < 1 then g = 1 end
for i = 3, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'leased', g)
  if tonumber(ARGV[4]) > 0 then redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
end
local doc = cjson.decode(ARGV[6])
doc['n'] = g
redis.call('SET', KEYS[1], cjson.encode(doc))
redis.call('SADD', KEYS[2], ARGV[5])
return {g, -1}
"""

# KEYS: slice, open slices, then the slice's counters. ARGV: used, at, slice id. Settles an open slice once:
# used (at most n) moves from leased to used on every counter. Returns the settled doc, or false.
_SETTLE_SLICE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
local doc = cjson.decode(raw)
if doc['state'] ~= 'open' then return false end
local n = tonumber(doc['n'])
local used = math.max(0, math.min(tonumber(ARGV[1]), n))
for i = 3, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'leased', -n)
  redis.call('HINCRBY', KEYS[i], 'used', used)
end
doc['state'] = 'settled'
doc['used'] = used
doc['settled_at'] = tonumber(ARGV[2])
local out = cjson.encode(doc)
redis.call('SET', KEYS[1], out, 'EX', 86400)
redis.call('SREM', KEYS[2], ARGV[3])
return out
"""


class RedisStore(Store):
    clock_name = "redis"

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise TetherError(
                f"--store {url}: the database must be a number, e.g. redis://HOST:6379/0", code=BAD_REQUEST
            )
        self._raw_url = url
        netloc = parts.netloc
        if parts.password is not None:
            netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        self.url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        self.prefix = f"tether:{db}:"
        self.channel = self.prefix + "events:appended"
        self._client: aioredis.Redis | None = None
        self._listener: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._scripts: dict[str, Any] = {}
        self._links_indexed = False

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- connection ----------------------------------------------------------------------------------
    async def open(self) -> None:
        # A blocking pool: under a burst (hundreds of parked long polls waking at once) commands wait for a
        # connection instead of failing with "too many connections", which would read as "Redis is down".
        pool = aioredis.BlockingConnectionPool.from_url(
            self._raw_url,
            max_connections=POOL_SIZE,
            timeout=COMMAND_TIMEOUT_S,
            decode_responses=True,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=COMMAND_TIMEOUT_S,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
        )
        client = aioredis.Redis(connection_pool=pool)
        self._client = client
        for name, source in (
            ("put_links", _PUT_LINKS),
            ("append_event", _APPEND_EVENT),
            ("put_reports", _PUT_REPORTS),
            ("put_doc", _PUT_DOC),
            ("append_record", _APPEND_RECORD),
            ("index_calls", _INDEX_CALLS),
            ("index_listed", _INDEX_LISTED),
            ("stage_reports", _STAGE_REPORTS),
            ("stage_next", _STAGE_NEXT),
            ("zslice", _ZSLICE),
            ("advance", _ADVANCE),
            ("split_record", _SPLIT_RECORD),
            ("try_lease", _TRY_LEASE),
            ("take_slice", _TAKE_SLICE),
            ("settle_slice", _SETTLE_SLICE),
        ):
            self._scripts[name] = client.register_script(source)
        self._listener = asyncio.create_task(self._listen(), name=f"tether-redis-listener {self.url}")
        if not await self.healthy():
            log.warning("Redis at %s is unreachable; answering 503 tether.store_unavailable until it is", self.url)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        if self._client is not None:
            await self._client.aclose(close_connection_pool=True)
            self._client = None
        self._wake_all()

    @property
    def r(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreUnavailable("the Redis store is not open")
        return self._client

    async def healthy(self) -> bool:
        try:
            return bool(await self.r.ping())
        except (*_UNAVAILABLE, StoreUnavailable):
            return False

    @_guarded
    async def reference_time(self) -> float | None:
        seconds, micros = await self.r.time()
        return int(seconds) + int(micros) / 1e6

    @_guarded
    @_writes
    async def probe_write(self) -> None:
        await self.r.set(self._key("health", "probe"), repr(time.time()), px=60_000)

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> int:
        return int(await self._scripts[script](keys=keys, args=args))

    # -- links ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_links(self, links: list[Doc]) -> int:
        if not links:
            return 0
        await self._index_links()
        args: list[str] = []
        keys = [self._key("links"), self._key("links", "jti"), self._key("links", "order")]
        for link in links:
            args += [link["hash"], link["jti"], _dump(link), link["sub"]]
            keys += [self._children_key(link.get("prf")), self._key("links", "sub", link["sub"])]
        answer = await self._scripts["put_links"](keys=keys, args=args)
        if int(answer[0]) < 0:
            raise LinkConflict(str(answer[1]), str(answer[2]))
        return int(answer[0])

    def _children_key(self, parent: str | None) -> str:
        """One hash per parent link: its children's link hashes -> their agents (roots share one)."""
        return self._key("links", "children", parent) if parent else self._key("links", "roots")

    async def _index_links(self) -> None:
        """Links registered before the indexes by parent and by subject existed are indexed once, by the
        replica that takes the job (a marker set with NX). A link another replica registers meanwhile may be
        listed twice under its subject: readers drop repeats."""
        if self._links_indexed:
            return
        marker = self._key("links", "indexed")
        if await self.r.set(marker, "1", nx=True):
            links = await self._hmget(self._key("links"), await self.r.lrange(self._key("links", "order"), 0, -1))
            async with self.r.pipeline(transaction=False) as pipe:
                for link in links:
                    pipe.hset(self._children_key(link.get("prf")), link["hash"], link["sub"])
                    pipe.rpush(self._key("links", "sub", link["sub"]), link["hash"])
                await pipe.execute()
        self._links_indexed = True

    @_guarded
    async def links_held_by(self, agent: str) -> list[Doc]:
        await self._index_links()
        hashes = await self.r.lrange(self._key("links", "sub", agent), 0, -1)
        return await self._hmget(self._key("links"), list(dict.fromkeys(hashes)))

    @_guarded
    async def descendants(self, link_hash: str) -> dict[str, str]:
        await self._index_links()
        found: dict[str, str] = {}
        frontier = [link_hash]
        while frontier:  # one round trip per level of the subtree
            async with self.r.pipeline(transaction=False) as pipe:
                for parent in frontier:
                    pipe.hgetall(self._children_key(parent))
                levels = await pipe.execute()
            below = {h: sub for children in levels for h, sub in children.items() if h not in found}
            below.pop(link_hash, None)
            found.update(below)
            frontier = sorted(below)
        return found

    @_guarded
    async def get_link(self, link_hash: str) -> Doc | None:
        raw = await self.r.hget(self._key("links"), link_hash)
        return json.loads(raw) if raw else None

    @_guarded
    async def link_by_jti(self, jti: str) -> Doc | None:
        link_hash = await self.r.hget(self._key("links", "jti"), jti)
        return await self.get_link(link_hash) if link_hash else None

    @_guarded
    async def jtis_beginning(self, prefix: str, limit: int = 21) -> list[str]:
        # HSCAN over the jti index: field names only, matched server-side (a prefix holds only hex characters,
        # so nothing in it is a glob character)
        found: list[str] = []
        async for jti, _ in self.r.hscan_iter(self._key("links", "jti"), match=f"{prefix}*", count=1000):
            found.append(jti)
            if len(found) >= limit:
                break
        return sorted(found)

    @_guarded
    async def all_links(self) -> list[Doc]:
        hashes = await self.r.lrange(self._key("links", "order"), 0, -1)
        return await self._hmget(self._key("links"), hashes)

    async def _hmget(self, key: str, fields: list[str]) -> list[Doc]:
        raws: list[str] = []
        for start in range(0, len(fields), 1000):  # a page per round trip, as in _zpages
            raws += [raw for raw in await self.r.hmget(key, fields[start : start + 1000]) if raw]
        if len(raws) <= 1000:
            return [json.loads(raw) for raw in raws]
        # A termination's worth of reports: decoded in a thread, one small call each, so the loop keeps going.
        return await asyncio.to_thread(lambda: [json.loads(raw) for raw in raws])

    # -- revocations -----------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def revoke(self, jti: str, doc: Doc) -> bool:
        return bool(await self.r.hsetnx(self._key("revocations"), jti, _dump(doc)))

    @_guarded
    async def revocations(self) -> dict[str, Doc]:
        return {jti: json.loads(raw) for jti, raw in (await self.r.hgetall(self._key("revocations"))).items()}

    @_guarded
    async def revoked_among(self, jtis: list[str]) -> set[str]:
        if not jtis:
            return set()
        flags = await self.r.hmget(self._key("revocations"), jtis)
        return {jti for jti, raw in zip(jtis, flags, strict=True) if raw}

    @_guarded
    @_writes
    async def first_use(self, key: str, ttl_s: float, now: float) -> bool:
        return bool(await self.r.set(self._key("seen", key), "1", nx=True, px=max(1, int(ttl_s * 1000))))

    # -- events ----------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def append_event(self, kind: str, target: str | None, payload: Doc, at: float) -> int:
        entry = _dump({"kind": kind, "target": target, "payload": payload, "at": at})
        return await self._run(
            "append_event", [self._key("events"), self._key("events", "seq")], [entry, EVENT_RETENTION, self.channel]
        )

    @_guarded
    async def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        members = await self.r.zrangebyscore(self._key("events"), f"({seq}", "+inf", start=0, num=limit)
        events: list[Event] = []
        for member in members:
            number, _, body = member.partition(":")
            doc = json.loads(body)
            events.append(Event(int(number), doc["kind"], doc["target"], doc["payload"], doc["at"]))
        return events

    @_guarded
    async def event_bounds(self) -> tuple[int, int]:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.get(self._key("events", "seq"))
            pipe.zrange(self._key("events"), 0, 0, withscores=True)
            last_raw, oldest = await pipe.execute()
        last = int(last_raw or 0)
        if not oldest:
            return (last + 1, last)  # never used: (1, 0); trimmed to nothing: (last + 1, last), as in SQLite
        return (int(oldest[0][1]), last)

    async def wait_events(self, after: int, timeout: float) -> None:
        """Return at once if the log is already past ``after`` (closing the gap between the caller's read and
        its wait), else on the next append by any replica, or after ``timeout``."""
        waiter = self._wake
        if await self._head() > after:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout)

    @_guarded
    async def _head(self) -> int:
        return int(await self.r.get(self._key("events", "seq")) or 0)

    def _wake_all(self) -> None:
        waiter, self._wake = self._wake, asyncio.Event()
        waiter.set()

    async def _listen(self) -> None:
        """Hold one subscription per replica and wake every local waiter on each append anywhere."""
        attempt = 0
        while True:
            pubsub = self.r.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                if attempt:
                    log.info("Redis at %s is reachable again; event wake-ups resume", self.url)
                attempt = 0
                self._wake_all()  # appends made while we were not subscribed: let waiters re-read
                while True:
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0) is not None:
                        self._wake_all()
            except _UNAVAILABLE as exc:
                attempt += 1
                if attempt == 1:
                    log.warning("event wake-ups from Redis at %s interrupted: %s", self.url, exc)
                self._wake_all()  # waiters re-read and find the store down
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(min(2.0, 0.05 * 2**attempt))

    # -- sidecars --------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_sidecar(self, run_id: str, doc: Doc) -> None:
        await self.r.hset(self._key("runs"), run_id, _dump(doc))

    @_guarded
    async def get_sidecar(self, run_id: str) -> Doc | None:
        raw = await self.r.hget(self._key("runs"), run_id)
        return json.loads(raw) if raw else None

    @_guarded
    async def all_sidecars(self) -> dict[str, Doc]:
        return {agent: json.loads(raw) for agent, raw in (await self.r.hgetall(self._key("runs"))).items()}

    # -- reports ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_reports(self, reports: list[Doc]) -> Stored:
        if not reports:
            return Stored(set(), 0)
        keys = [self._key("reports"), self._key("reports", "order"), self._key("reports", "n"),
                self._key("reports", "entry"), self._key("reports", "link")]
        args: list[str] = []
        for report in reports:
            keys += [self._key("reports", "agent", report["agent"]), self._key("reports", "started", report["agent"])]
            args += [report["call_id"], _dump(report), repr(float(report.get("started_at") or 0)),
                     entry_text(report), report.get("link") or "-"]
        new = {str(i) for i in await self._scripts["put_reports"](keys=keys, args=args)}  # decoded: str
        by_agent: dict[str, list[str]] = {}
        for report in reports:
            by_agent.setdefault(report["agent"], []).append(_start_field(report))
        async with self.r.pipeline(transaction=False) as pipe:  # the reporting agents' own starts are moot now
            pipe.hdel(self._key("starts"), *[f for fields in by_agent.values() for f in fields])
            for agent, fields in by_agent.items():  # one command per agent, not one per report
                pipe.srem(self._key("starts", "agent", agent), *fields)
            await pipe.execute()
        return Stored(new, len(reports))

    @_guarded
    @_writes
    async def put_starts(self, starts: list[Doc]) -> None:
        if not starts:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for start in starts:
                pipe.hexists(self._key("reports"), start["call_id"])
            ended = await pipe.execute()
        async with self.r.pipeline(transaction=False) as pipe:
            for start, done in zip(starts, ended, strict=True):
                if not done:
                    pipe.hsetnx(self._key("starts"), _start_field(start), _dump(start))
                    pipe.sadd(self._key("starts", "agent", start["agent"]), _start_field(start))
            await pipe.execute()

    @_guarded
    async def starts(self, agents: list[str]) -> list[Doc]:
        async with self.r.pipeline(transaction=False) as pipe:
            for agent in agents:
                pipe.smembers(self._key("starts", "agent", agent))
            call_ids = sorted({c for members in await pipe.execute() for c in members})
        return await self._hmget(self._key("starts"), call_ids)

    @_guarded
    async def reports(self, agents: list[str] | None = None) -> list[Doc]:
        if agents is None:
            call_ids = [c for c, _ in await self._zpages(self._key("reports", "order"))]
        else:
            ranked: list[tuple[float, str]] = []
            for agent in agents:
                ranked += [(score, c) for c, score in await self._zpages(self._key("reports", "agent", agent))]
            call_ids = [call_id for _, call_id in sorted(ranked)]
        return await self._hmget(self._key("reports"), call_ids)

    async def _zpages(self, key: str, page: int = 1000) -> list[tuple[str, float]]:
        """A whole sorted set, a page per round trip: redis-py parses a reply in Python on the event loop,
        and a termination's 20,000 reports in one reply would hold the loop for a large part of a second."""
        out: list[tuple[str, float]] = []
        while True:
            rows = await self.r.zrange(key, len(out), len(out) + page - 1, withscores=True)
            out += rows
            if len(rows) < page:
                return out

    # -- documents -----------------------------------------------------------------------------------
    def _doc_keys(self, kind: str) -> list[str]:
        return [
            self._key("docs", kind),
            self._key("docs", kind, "version"),
            self._key("docs", kind, "order"),
            self._key("docs", "n"),
        ]

    @_guarded
    @_writes
    async def put_doc(self, kind: str, doc_id: str, doc: Doc) -> None:
        await self._run("put_doc", self._doc_keys(kind), [doc_id, "", int(doc.get("version", 0)), _dump(doc)])

    @_guarded
    async def get_doc(self, kind: str, doc_id: str) -> Doc | None:
        raw = await self.r.hget(self._key("docs", kind), doc_id)
        return json.loads(raw) if raw else None

    @_guarded
    async def list_docs(self, kind: str) -> list[Doc]:
        ids = await self.r.zrange(self._key("docs", kind, "order"), 0, -1)
        return await self._hmget(self._key("docs", kind), ids)

    @_guarded
    @_writes
    async def cas_doc(self, kind: str, doc_id: str, expect_version: int, doc: Doc) -> bool:
        args = [doc_id, int(expect_version), int(doc["version"]), _dump(doc)]
        return bool(await self._run("put_doc", self._doc_keys(kind), args))

    # -- records ---------------------------------------------------------------------------------------
    # The chain is a list of headers (every field but ``calls``); a record's calls are a list of their own,
    # ``records:calls:<record id>``, staged (expiring) before the header is appended. Who holds a call is an
    # index of the log, ``records:owner`` (call id -> the first record holding it as reported) and
    # ``records:unknown`` (call id -> the records listing it unknown), filled oldest record first; the count
    # of records indexed is ``records:indexed``, so a record appended by a replica that died before indexing
    # it is indexed by the next reader.
    def _calls_key(self, record_id: str) -> str:
        return self._key("records", "calls", record_id)

    def _ids_key(self, record_id: str) -> str:
        """Beside a record's calls, each call's id and whether it is reported ('1 ID' or '0 ID'): what the
        index of the log reads, without decoding the entries."""
        return self._key("records", "ids", record_id)

    @_guarded
    @_writes
    async def append_record(self, record: Doc, staged: int | None = None) -> bool:
        header = {k: v for k, v in record.items() if k != "calls"}
        rid = header["record_id"]
        if staged is None:
            await self.r.delete(self._calls_key(rid), self._ids_key(rid))
            entries = await asyncio.to_thread(lambda: [
                (c["call_id"], c.get("reported", True) is not False, encode_entry(c)) for c in record["calls"]])
            for start in range(0, len(entries), 1000):
                await self.stage_calls(rid, start, entries[start:start + 1000])
            staged = len(entries)
        encoded = await asyncio.to_thread(jsonpieces.dumps, header)
        args = [record["prev_hash"], record["hash"], encoded, staged]
        done = await self._run("append_record", [self._key("records"), self._key("records", "head"),
                                                 self._calls_key(rid), self._ids_key(rid)], args)
        if done < 0:
            raise ValueError(f"record {rid}: the staged call entries are not the {staged} expected")
        if not done:
            return False
        await self._index_records()
        return True

    @_guarded
    @_writes
    async def stage_calls(self, record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> None:
        if not entries:
            return
        async with self.r.pipeline(transaction=False) as pipe:  # a part written is caught by append's count
            pipe.rpush(self._calls_key(record_id), *[text for _, _, text in entries])
            pipe.rpush(self._ids_key(record_id), *[("1 " if reported else "0 ") + cid for cid, reported, _ in entries])
            pipe.pexpire(self._calls_key(record_id), STAGED_TTL_MS)
            pipe.pexpire(self._ids_key(record_id), STAGED_TTL_MS)
            await pipe.execute()

    @_guarded
    @_writes
    async def drop_staged(self, record_id: str) -> None:
        await self.r.delete(self._calls_key(record_id), self._ids_key(record_id))

    @_guarded
    async def record_heads(self, start: int = 0) -> list[Doc]:
        try:
            await self._index_records()
        except StoreUnwritable:
            refused = True  # reads still answer while Redis refuses writes (the index waits for the next reader)
        else:
            refused = False
        raws = await self.r.lrange(self._key("records"), max(0, start), -1)
        heads = await asyncio.to_thread(lambda: [json.loads(raw) for raw in raws])
        if refused and any("calls" in head for head in heads):
            raise StoreUnwritable(f"Redis at {self.url} refuses writes: a record stored whole cannot be split yet")
        return heads

    async def record_calls(self, record_id: str, page: int = 2000) -> AsyncIterator[list[str]]:
        """A page of the record's calls; an entry staged from a report ('') is the text kept beside it."""
        at = 0
        async for texts in self._pages(self._calls_key(record_id), page):
            if "" in texts:
                marks = await self._lrange(self._ids_key(record_id), at, at + len(texts) - 1)
                refs = [i for i, text in enumerate(texts) if text == ""]
                kept = await self._texts([marks[i][2:] for i in refs])
                for i, text in zip(refs, kept, strict=True):
                    texts[i] = text
            at += len(texts)
            yield texts

    async def _pages(self, key: str, page: int) -> AsyncIterator[list[str]]:
        start = 0
        while True:
            texts = await self._lrange(key, start, start + page - 1)
            if texts:
                yield texts
            if len(texts) < page:
                return
            start += page

    @_guarded
    async def _lrange(self, key: str, start: int, stop: int) -> list[str]:
        return await self.r.lrange(key, start, stop)

    @_guarded
    async def call_holders(self, call_ids: list[str]) -> dict[str, tuple[str | None, tuple[str, ...]]]:
        await self._index_records()
        out: dict[str, tuple[str | None, tuple[str, ...]]] = {}
        for start in range(0, len(call_ids), 1000):
            ids = call_ids[start:start + 1000]
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hmget(self._key("records", "owner"), ids)
                pipe.hmget(self._key("records", "unknown"), ids)
                owners, unknowns = await pipe.execute()
            for cid, owner, unknown in zip(ids, owners, unknowns, strict=True):
                if owner or unknown:
                    out[cid] = (owner or None, tuple((unknown or "").split()))
        return out

    @_guarded
    async def unknown_calls(self) -> dict[str, tuple[str, ...]]:
        await self._index_records()
        listed = await self.r.hgetall(self._key("records", "unknown"))
        return {cid: tuple(rids.split()) for cid, rids in listed.items()}

    @_guarded
    async def _index_records(self) -> None:
        """Index every record appended and not yet indexed, oldest first (usually none: two small reads)."""
        counter = self._key("records", "indexed")
        while True:
            async with self.r.pipeline(transaction=False) as pipe:  # not MULTI: Redis refuses it when out of memory
                pipe.get(counter)
                pipe.llen(self._key("records"))
                done_raw, total = await pipe.execute()
            done = int(done_raw or 0)
            if done >= int(total):
                return
            raw = await self.r.lindex(self._key("records"), done)
            head = await asyncio.to_thread(json.loads, raw)
            if "calls" in head:  # stored whole, by a control plane from before: split it once
                calls = head.pop("calls")
                texts = await asyncio.to_thread(lambda c=calls: [encode_entry(e) for e in c])
                await self._run("split_record", [self._key("records"), self._calls_key(head["record_id"])],
                                [done, raw, jsonpieces.dumps(head), *texts])
            rid = head["record_id"]
            indexes = [self._key("records", "owner"), self._key("records", "unknown")]
            if await self.r.exists(self._ids_key(rid)):  # the ids beside its calls, read inside Redis
                at = 0
                while await self._run("index_listed", [*indexes, self._ids_key(rid)], [rid, at, at + 4999]) == 5000:
                    at += 5000
            else:  # split from a whole record: decode its entries
                async for page in self.record_calls(rid, 1000):
                    await self._run("index_calls", indexes, [rid, *await asyncio.to_thread(_holder_args, page)])
            await self._run("advance", [counter], [done, done + 1])

    async def report_pages(self, agents: list[str], page: int = 2000) -> AsyncIterator[list[Doc]]:
        async for ids in self._ordered_ids(agents, page):
            yield await self._hmget(self._key("reports"), ids)

    async def _ordered_ids(self, agents: list[str], page: int) -> AsyncIterator[list[str]]:
        """The agents' indexes by start, merged: each read a slice at a time from where it stopped (by score,
        then by member), so no command's cost grows with the termination (a ZUNIONSTORE of 200,000 members
        holds Redis, and every replica's requests, for most of a second). A report stored meanwhile is
        included when it sorts after the point reached, and never twice."""
        if not agents:
            return
        for agent in agents:
            await self._index_starts(agent)
        slice_n = max(100, page // len(agents))
        cursors = [_Cursor(self._key("reports", "started", a)) for a in agents]
        while True:
            ids: list[str] = []
            while len(ids) < page:
                for cursor in cursors:
                    while not cursor.buffer and not cursor.done:
                        await self._fill(cursor, slice_n)
                heads = [c for c in cursors if c.buffer]
                if not heads:
                    break
                if len(heads) == 1:  # one agent left: its slice as it is
                    ids += heads[0].take(page - len(ids))
                    continue
                # Several: take from the lowest while it stays at most every other's first (its slice is sorted).
                heads.sort(key=lambda c: c.buffer[0])
                bound = heads[1].buffer[0]
                lowest = heads[0]
                n = 0
                while n < len(lowest.buffer) and lowest.buffer[n] <= bound and len(ids) + n < page:
                    n += 1
                ids += lowest.take(max(1, n))
            if ids:
                yield ids
            if len(ids) < page:
                return

    async def stage_reports(self, record_id: str, start: int, agents: list[str], links: set[str],
                            page: int = 5000) -> AsyncIterator[StagedPage]:
        """Per part of a page, one script that stages the calls inside Redis (``_STAGE_BODY``: references to the
        entry texts kept beside the reports) and answers with those texts, to be hashed. One agent: the script
        reads the ids from the agent's index by start itself (``_STAGE_NEXT``), so only the texts cross the
        wire; several: ids in the record's order (``_ordered_ids``), merged here. Nothing is decoded or encoded
        here, but the entries of reports stored before entries were kept."""
        await self._index_records()
        keys = [self._key("reports", "link"), self._key("records", "owner"), self._key("records", "unknown"),
                self._calls_key(record_id), self._ids_key(record_id), self._key("reports", "entry")]
        head = [STAGED_TTL_MS, len(links), *sorted(links)]
        pages = (self._stage_one(agents[0], keys, head, page) if len(set(agents)) == 1
                 else self._stage_merged(agents, keys, head, page))
        async for staged in pages:
            yield staged

    async def _stage_one(self, agent: str, keys: list[str], head: list[Any], page: int) -> AsyncIterator[StagedPage]:
        """``stage_reports`` of one agent: pages of ``page`` reports read, each read and staged inside Redis
        ``STAGE_PART`` at a time from after the last id read."""
        await self._index_starts(agent)
        keys = [*keys, self._key("reports", "started", agent)]
        after = ""
        while True:
            out = _Staging()
            done = False
            while out.read < page and not done:
                want = min(STAGE_PART, page - out.read)
                reply = await self._staged("stage_next", keys, [*head, after, want])
                out.add(reply)
                read = int(reply[5])
                out.read += read
                after = reply[4] or after
                done = read < want
            if out.read:
                yield out.page()
            if done:
                return

    async def _stage_merged(self, agents: list[str], keys: list[str], head: list[Any],
                            page: int) -> AsyncIterator[StagedPage]:
        """``stage_reports`` of several agents: ids merged in the record's order here (``_ordered_ids``)."""
        async for ids in self._ordered_ids(agents, page):
            out = _Staging()
            for at in range(0, len(ids), STAGE_PART):
                out.add(await self._staged("stage_reports", keys, [*head, *ids[at:at + STAGE_PART]]))
            yield out.page()

    async def _staged(self, script: str, keys: list[str], args: list[Any]) -> list[Any]:
        """One staging script's reply; reports stored before entries were kept get theirs first (once)."""
        reply = await self._stage_part(script, keys, args)
        if int(reply[0]) == 0:
            await self._keep_entries(reply[1])
            reply = await self._stage_part(script, keys, args)
            if int(reply[0]) == 0:
                raise ValueError(f"no report for {len(reply[1])} calls of the index")
        return reply

    @_guarded
    @_writes
    async def _stage_part(self, script: str, keys: list[str], args: list[Any]) -> list[Any]:
        return list(await self._scripts[script](keys=keys, args=args))

    @_guarded
    async def _texts(self, call_ids: list[str]) -> list[str]:
        """The entry texts kept beside these calls' reports, in order."""
        texts: list[str] = []
        for at in range(0, len(call_ids), 5000):
            part = await self.r.hmget(self._key("reports", "entry"), call_ids[at:at + 5000])
            if not all(part):
                raise ValueError("a staged call has no entry text kept beside its report")
            texts += part
        return texts

    @_guarded
    @_writes
    async def _keep_entries(self, call_ids: list[str]) -> None:
        """Entries and links for reports stored before they were kept beside them (once: then as any other)."""
        docs = await self._hmget(self._key("reports"), call_ids)
        entries = await asyncio.to_thread(lambda: {d["call_id"]: entry_text(d) for d in docs})
        links = {d["call_id"]: d.get("link") or "-" for d in docs}
        for at in range(0, len(docs), 1000):
            cids = [d["call_id"] for d in docs[at:at + 1000]]
            async with self.r.pipeline(transaction=False) as pipe:  # the entry first: a link means it is there
                pipe.hset(self._key("reports", "entry"), mapping={c: entries[c] for c in cids})
                pipe.hset(self._key("reports", "link"), mapping={c: links[c] for c in cids})
                await pipe.execute()

    @_guarded
    async def _fill(self, cursor: _Cursor, n: int) -> None:
        low = "-inf" if cursor.score is None else repr(cursor.score)
        # Through a script: its flat reply skips redis-py's per-member score conversion (the larger part of
        # reading a big termination's index on the loop); the scores are Redis's own spelling, read exactly.
        flat = await self._scripts["zslice"](keys=[cursor.key], args=[low, cursor.at_score, n])
        cursor.refill([(float(flat[i + 1]), flat[i]) for i in range(0, len(flat), 2)], n)

    @_guarded
    async def _index_starts(self, agent: str) -> None:
        """Reports stored before the index by start existed get into it (once: then both indexes agree)."""
        by_arrival, by_start = self._key("reports", "agent", agent), self._key("reports", "started", agent)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zcard(by_arrival)
            pipe.zcard(by_start)
            arrived, started = await pipe.execute()
        if int(arrived) == int(started):
            return
        for start in range(0, int(arrived), 1000):
            ids = await self.r.zrange(by_arrival, start, start + 999)
            docs = await self._hmget(self._key("reports"), ids)
            if docs:
                await self.r.zadd(by_start, {d["call_id"]: float(d.get("started_at") or 0) for d in docs})

    @_guarded
    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        return await self._hmget(self._key("reports"), list(call_ids))

    # -- leases ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def try_lease(self, name: str, owner: str, ttl_s: float, now: float) -> bool:
        gc_ms = int(ttl_s * 1000) + LEASE_GC_SLACK_MS
        args = [owner, repr(float(now)), repr(float(now + ttl_s)), gc_ms]
        return bool(await self._run("try_lease", [self._key("lease", name)], args))

    # -- budgets ----------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def take_slice(self, slice_doc: Doc, counters: list[tuple[str, int]], want: int, fraction: float,
                         ttl_s: float = 0) -> tuple[int, int | None]:
        doc = {**slice_doc, "state": "open", "keys": [k for k, _ in counters]}
        keys = [self._key("slice", doc["id"]), self._key("slices", "open")]
        keys += [self._key("budget", k) for k, _ in counters]
        args: list[Any] = [int(want), repr(float(fraction)), MAX_SLICE, int(ttl_s * 1000), doc["id"], _dump(doc)]
        args += [int(limit) for _, limit in counters]
        granted, worst = await self._scripts["take_slice"](keys=keys, args=args)
        return int(granted), None if int(worst) < 0 else int(worst)

    @_guarded
    @_writes
    async def settle_slice(self, slice_id: str, used: int, at: float) -> Doc | None:
        raw = await self.r.get(self._key("slice", slice_id))
        if not raw:
            return None
        keys = [self._key("slice", slice_id), self._key("slices", "open")]
        keys += [self._key("budget", k) for k in json.loads(raw)["keys"]]  # fixed when the slice was taken
        out = await self._scripts["settle_slice"](keys=keys, args=[int(used), repr(float(at)), slice_id])
        return json.loads(out) if out else None

    @_guarded
    async def open_slices(self) -> list[Doc]:
        ids = sorted(await self.r.smembers(self._key("slices", "open")))
        raws = await self.r.mget([self._key("slice", i) for i in ids]) if ids else []
        return [json.loads(raw) for raw in raws if raw]

    @_guarded
    async def budget_counts(self, counters: list[str]) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        async with self.r.pipeline(transaction=False) as pipe:
            for key in counters:
                pipe.hmget(self._key("budget", key), ["used", "leased"])
            rows = await pipe.execute()
        for key, (used, leased) in zip(counters, rows, strict=True):
            out[key] = (int(used or 0), int(leased or 0))
        return out
