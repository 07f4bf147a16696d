"""The Redis store's shared part: connection handling, write-refusal handling, the Lua scripts (``RedisCore``).

The store is ``RedisStore`` in ``tether/controlplane/store/redis.py``, composed of this and one mixin per concern; its
module docstring describes the key layout.
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

from tether.capability.errors import BAD_REQUEST, TetherError

from .base import Doc, Holders, StagedPage, Store, StoreUnavailable, StoreUnwritable

log = logging.getLogger("tether.store.redis")

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
        store: RedisCore = args[0]  # type: ignore[assignment]
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
# KEYS: reports, order, counter, entries, links, chains' loose counts, chains' agents, the agents whose index of
# loose reports is whole, the chains' closers; then per report: its agent's index by arrival, by start, and of
# its reports no segment holds (``reports:loose:AGENT``). ARGV per report: call id, doc, start, entry text,
# link ('-': none), agent.
_PUT_REPORTS = """
local new, seen, loose, agent_of = {}, {}, {}, {}
for i = 1, #ARGV, 6 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    local n = redis.call('INCR', KEYS[3])
    local k = (i + 5) / 6
    local agent, link = ARGV[i + 5], ARGV[i + 4]
    redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 3])
    redis.call('HSET', KEYS[5], ARGV[i], link)
    redis.call('ZADD', KEYS[2], n, ARGV[i])
    if not seen[agent] then  -- an agent's first report: its index of loose reports is whole from the start
      seen[agent] = true
      if redis.call('ZCARD', KEYS[7 + 3 * k]) == 0 then redis.call('SADD', KEYS[8], agent) end
    end
    redis.call('ZADD', KEYS[7 + 3 * k], n, ARGV[i])
    redis.call('ZADD', KEYS[8 + 3 * k], ARGV[i + 2], ARGV[i])
    redis.call('ZADD', KEYS[9 + 3 * k], ARGV[i + 2], ARGV[i])
    if link ~= '-' then
      loose[link] = (loose[link] or 0) + 1
      agent_of[link] = agent
    end
    new[#new + 1] = ARGV[i]
  end
end
for link, n in pairs(loose) do
  -- a closed chain is never sealed again: no count of its loose reports (the sealer reads every count)
  if redis.call('HEXISTS', KEYS[9], link) == 0 then redis.call('HINCRBY', KEYS[6], link, n) end
  redis.call('HSETNX', KEYS[7], link, agent_of[link])
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
  if not rank then
    -- Sealed into a segment since it was staged (KEYS[7] holds the reports no segment holds): the point
    -- reached is found by its start (KEYS[8], the index by start); the record's append then fails on the
    -- chain that moved, and the record is built again.
    local score = redis.call('ZSCORE', KEYS[8], after)
    if not score then return redis.error_reply('tether: ' .. after .. ' left the index by start') end
    from = redis.call('ZCOUNT', KEYS[7], '-inf', '(' .. score)
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], score, score)) do
      if member < after then from = from + 1 end
    end
  else
    from = rank + 1
  end
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

# The log's index (``base.index_keys``): ``records:keys``, key -> the positions of the records filed under it,
# space-separated, oldest first; ``records:keyed``, how many records (oldest first) it holds. A record is filed
# by its append (below) when every record before it is; one appended before the index existed (or by an older
# control plane) is filed by the next reader (``_INDEX_HEADS``), oldest first.
_FILE_RECORD = """
local function file_record(keys_key, pos, first, last)
  for i = first, last do
    local have = redis.call('HGET', keys_key, ARGV[i])
    redis.call('HSET', keys_key, ARGV[i], have and (have .. ' ' .. pos) or tostring(pos))
  end
end
"""

# KEYS: records, head, the record's staged calls and their ids, the index's count, the index. ARGV: prev_hash,
# hash, header, how many calls are staged, then the record's index keys. One chain: append only on the current
# head; the staged calls stay (no longer expiring); the record filed in the index when all before it are. -1: a
# count mismatch (a staging write that ran twice): nothing appended, the caller builds the record anew.
_APPEND_RECORD = _FILE_RECORD + """
local head = redis.call('GET', KEYS[2]) or ''
if head ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[4]) then return -1 end
local pos = redis.call('RPUSH', KEYS[1], ARGV[3]) - 1
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PERSIST', KEYS[3])
redis.call('PERSIST', KEYS[4])
if tonumber(redis.call('GET', KEYS[5]) or '0') == pos then
  file_record(KEYS[6], pos, 5, #ARGV)
  redis.call('SET', KEYS[5], pos + 1)
end
return 1
"""

# ``_APPEND_RECORD`` that also closes chains of sealed segments (record form 2). KEYS: as it, then the chains'
# seqs, the records that closed them and the loose counts. ARGV: prev_hash, hash, header, staged, record id, how
# many chains, per chain its link and the seq its writer read, then the record's index keys. 2 (nothing
# written): a chain moved.
_APPEND_CLOSING = _FILE_RECORD + """
local head = redis.call('GET', KEYS[2]) or ''
if head ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[4]) then return -1 end
local nclose = tonumber(ARGV[6])
for j = 0, nclose - 1 do
  local link, seq = ARGV[7 + 2 * j], tonumber(ARGV[8 + 2 * j])
  if tonumber(redis.call('HGET', KEYS[7], link) or '0') ~= seq then return 2 end
end
for j = 0, nclose - 1 do
  redis.call('HSETNX', KEYS[8], ARGV[7 + 2 * j], ARGV[5])
  redis.call('HDEL', KEYS[9], ARGV[7 + 2 * j])  -- closed: never sealed again, so no count the sealer reads
end
local pos = redis.call('RPUSH', KEYS[1], ARGV[3]) - 1
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PERSIST', KEYS[3])
redis.call('PERSIST', KEYS[4])
if tonumber(redis.call('GET', KEYS[5]) or '0') == pos then
  file_record(KEYS[6], pos, 7 + 2 * nclose, #ARGV)
  redis.call('SET', KEYS[5], pos + 1)
end
return 1
"""

# A sealed segment appended to its link's chain. KEYS: the chains' seqs, heads, counts, lasts, closers, loose
# counts; the chain's segment headers; the segment's call ids; the agent's index of reports no segment holds.
# ARGV: link, seq, prev, header, hash, last ('START CALL_ID'), the call ids as one JSON array (one argument:
# redis-py encodes each argument in Python, on the event loop, and a segment has up to 10,000 calls). 0: the
# chain moved or was closed; -1: a call is no longer loose (nothing written).
_APPEND_SEGMENT = """
local link = ARGV[1]
if tonumber(redis.call('HGET', KEYS[1], link) or '0') ~= tonumber(ARGV[2]) - 1 then return 0 end
if (redis.call('HGET', KEYS[2], link) or '') ~= ARGV[3] then return 0 end
if redis.call('HEXISTS', KEYS[5], link) == 1 then return 0 end
local ids = cjson.decode(ARGV[7])
for i = 1, #ids do
  if not redis.call('ZSCORE', KEYS[9], ids[i]) then return -1 end
end
for i = 1, #ids, 1000 do
  redis.call('ZREM', KEYS[9], unpack(ids, i, math.min(i + 999, #ids)))
  redis.call('RPUSH', KEYS[8], unpack(ids, i, math.min(i + 999, #ids)))
end
redis.call('RPUSH', KEYS[7], ARGV[4])
redis.call('HSET', KEYS[1], link, ARGV[2])
redis.call('HSET', KEYS[2], link, ARGV[5])
redis.call('HINCRBY', KEYS[3], link, #ids)
redis.call('HSET', KEYS[4], link, ARGV[6])
redis.call('HINCRBY', KEYS[6], link, -#ids)
return 1
"""

# One page of a chain's seal candidates, filtered inside Redis: the agent's reports no segment holds, by start,
# from ``low`` to before ``cut``, that belong to the link and sort after the chain's last sealed call. KEYS: the
# agent's index of loose reports, the reports' links, their entry texts. ARGV: link, low, cut, the last call's
# start ('' when none) and id, offset, page size, how many are still wanted. Returns how many rows it read
# (fewer than the page when it had enough), then per call taken: its start as Redis spells it, its id, its
# entry text ('' when none). The page is bounded (a script holds Redis); the caller asks again from
# ``offset + read``. Call ids compare by their bytes (as Python compares them: UTF-8 keeps code point order),
# never by Lua's ``<``, which follows the server's locale.
_SEAL_PAGE = """
local function after(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end
local link, last, last_id = ARGV[1], nil, ARGV[5]
if ARGV[4] ~= '' then last = tonumber(ARGV[4]) end
local want = tonumber(ARGV[8])
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[2], '(' .. ARGV[3], 'WITHSCORES', 'LIMIT', ARGV[6], ARGV[7])
local out, read = {0}, 0
for i = 1, #rows, 2 do
  if #out > 3 * want then break end
  read = read + 1
  local cid = rows[i]
  if redis.call('HGET', KEYS[2], cid) == link then
    local score = tonumber(rows[i + 1])
    if last == nil or score > last or (score == last and after(cid, last_id)) then
      out[#out + 1] = rows[i + 1]
      out[#out + 1] = cid
      out[#out + 1] = redis.call('HGET', KEYS[3], cid) or ''
    end
  end
end
out[1] = read
return out
"""

# KEYS: the index's count, the index. ARGV: the position of the first record to file (the count expected),
# then per record: how many keys, and its keys. Nothing when another reader filed them first.
_INDEX_HEADS = _FILE_RECORD + """
local pos = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= pos then return 0 end
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  file_record(KEYS[2], pos, i + 1, i + n)
  i = i + n + 1
  pos = pos + 1
end
redis.call('SET', KEYS[1], pos)
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


class RedisCore(Store):
    """The connection pool, the registered scripts and the key names: what every part of the Redis store uses."""

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
            ("append_closing", _APPEND_CLOSING),
            ("append_segment", _APPEND_SEGMENT),
            ("seal_page", _SEAL_PAGE),
            ("index_heads", _INDEX_HEADS),
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

    async def _hmget(self, key: str, fields: list[str]) -> list[Doc]:
        raws: list[str] = []
        for start in range(0, len(fields), 1000):  # a page per round trip, as in _zpages
            raws += [raw for raw in await self.r.hmget(key, fields[start : start + 1000]) if raw]
        if len(raws) <= 1000:
            return [json.loads(raw) for raw in raws]
        # A termination's worth of reports: decoded in a thread, one small call each, so the loop keeps going.
        return await asyncio.to_thread(lambda: [json.loads(raw) for raw in raws])

    async def _zpages(self, key: str, page: int = 1000) -> list[tuple[str, float]]:
        """A whole sorted set, a page per round trip: redis-py parses a reply in Python on the event loop,
        and a termination's 20,000 reports in one reply would hold the loop for a large part of a second."""
        out: list[tuple[str, float]] = []
        while True:
            rows = await self.r.zrange(key, len(out), len(out) + page - 1, withscores=True)
            out += rows
            if len(rows) < page:
                return out

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
