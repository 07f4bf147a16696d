"""Sealed segments: a record of any size written in the time of its last calls (record form 2).

While an agent runs, the control plane seals its finished reports, in the record's order, into segments: one
hash chain per link (its agent is the link's subject), each segment signed with the control plane's key and
naming the hash of the one before. A termination's record then names each chain of its links (``segments``:
link, agent, seq of the head, the head's hash, how many calls) and lists in ``calls`` only what was not
sealed; its hash is taken as it always was, over the record as stored, so it covers every segment through the
head's hash. The record's append closes the chains of its links: a segment belongs to the first (and only)
record that names it. See docs/termination.md, "Sealed segments".

A record is served (``GET /v1/records``) with its calls expanded, every call in the record's order, plus
``sealed`` (the headers of the segments named, chain by chain, oldest first) and ``calls_from`` (run lengths:
``[source, n]``, ``source`` an index into ``sealed`` or -1 for the record's own calls). ``stored_form`` gives
back the record as hashed; ``check_served`` checks the segments of a served record.

Pure: no I/O here. The stores keep segments (``Store.append_segment``); ``services/segments.py`` seals them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tether.capability import keys

Doc = dict[str, Any]
SERVED_ONLY = ("sealed", "calls_from")  # fields a served record of form 2 carries that its hash does not cover
OWN = -1  # ``calls_from``: the record's own calls


def segment_hash(header: Mapping[str, Any], entries: Iterable[str]) -> str:
    """The hash of a segment: ``sha256:`` of the canonical JSON of its header (all but ``hash`` and
    ``signature``) with its calls, the same framing as a record's (``termination.header_hash``)."""
    from .termination import header_hash

    return header_hash(header, entries)


def segment_header(*, agent: str, link: str, seq: int, prev: str, keys_of_calls: Sequence[tuple[float, str]],
                   sealed_at: float, key_id: str) -> Doc:
    """The header of a new segment holding calls whose (``started_at``, ``call_id``) are ``keys_of_calls``, in
    order (unsigned)."""
    first, last = keys_of_calls[0], keys_of_calls[-1]
    return {"agent": agent, "link": link, "seq": seq, "prev": prev, "count": len(keys_of_calls),
            "first": [first[0], first[1]], "last": [last[0], last[1]], "sealed_at": sealed_at, "key_id": key_id}


def sign_segment(header: Doc, entries: Iterable[str], signing_key: Any) -> Doc:
    """A segment's header with its ``hash`` and ``signature``."""
    digest = segment_hash(header, entries)
    return {**header, "hash": digest, "signature": keys.b64url(signing_key.sign(digest.encode("ascii")))}


def chain_ref(chain: Mapping[str, Any]) -> Doc:
    """What a record names of a chain (a store's chain row: link, agent, seq, head, count)."""
    return {"link": chain["link"], "agent": chain["agent"], "seq": chain["seq"], "head": chain["head"],
            "count": chain["count"]}


# -- a served record ------------------------------------------------------------------------------------
def runs_of(sources: Iterable[int]) -> list[list[int]]:
    """Run lengths of a sequence of sources (``calls_from``)."""
    out: list[list[int]] = []
    for source in sources:
        if out and out[-1][0] == source:
            out[-1][1] += 1
        else:
            out.append([source, 1])
    return out


def sources_of(calls_from: Sequence[Any]) -> Iterator[int]:
    for run in calls_from:
        source, n = run
        for _ in range(int(n)):
            yield int(source)


def served(record: Mapping[str, Any]) -> bool:
    """A record as served with its segments' calls expanded (``calls_from`` says which are its own)."""
    return "segments" in record and "calls_from" in record


def well_formed(record: Mapping[str, Any]) -> bool:
    """A served record of form 2 whose served-only fields have their shapes (``calls_from`` pairs of integers,
    ``sealed`` and ``segments`` lists of objects, ``calls`` a list): anything else is refused as a problem of
    the record, never a crash of the verifier."""
    def pair(run: Any) -> bool:
        return (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run) and run[1] >= 0)

    return (isinstance(record.get("calls_from"), list) and all(pair(r) for r in record["calls_from"])
            and isinstance(record.get("sealed"), list) and all(isinstance(x, dict) for x in record["sealed"])
            and isinstance(record.get("segments"), list) and all(isinstance(x, dict) for x in record["segments"])
            and isinstance(record.get("calls"), list))


def stored_form(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """The record as hashed: a served record of form 2 without its served-only fields and with only its own
    calls; any other record as it is."""
    if not served(record) or not well_formed(record):
        return record  # a malformed one hashes as it is: its hash fails, named
    calls = record.get("calls") or []
    own = [call for call, source in zip(calls, sources_of(record["calls_from"]), strict=False) if source == OWN]
    return {**{k: v for k, v in record.items() if k not in SERVED_ONLY}, "calls": own}


def _chain_problems(ref: Mapping[str, Any], segments: Sequence[tuple[Mapping[str, Any], str]],
                    signers: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with one chain a record names: ``segments``, its segments oldest first with the hash of
    each one's content as recomputed; ``signers``, key id -> public key of the keys the log was signed with
    (None: signatures not checked, for a record trusted by its hash alone: the head it names pins every
    segment through the ``prev`` links, whichever key sealed them)."""
    from cryptography.exceptions import InvalidSignature

    problems: list[str] = []
    link = str(ref.get("link"))[:16]
    prev, total = "", 0
    for n, (segment, digest) in enumerate(segments, start=1):
        what = f"segment {segment.get('seq')} of link {link}"
        if (segment.get("seq"), segment.get("link"), segment.get("agent")) != (n, ref.get("link"), ref.get("agent")):
            problems.append(f"{what}: not segment {n} of the chain the record names (removed, inserted or moved)")
        if segment.get("prev") != prev:
            problems.append(f"{what}: prev does not name segment {n - 1} (a segment removed, inserted or reordered)")
        if segment.get("hash") != digest:
            problems.append(f"{what}: content does not match its hash (edited)")
        if signers is not None:
            key = signers.get(str(segment.get("key_id")))
            try:
                if key is None:
                    raise ValueError
                key.verify(keys.b64url_decode(str(segment.get("signature", ""))),
                           str(segment.get("hash", "")).encode())
            except (InvalidSignature, ValueError):
                problems.append(f"{what}: signature does not verify under a key of the log")
        total += int(segment.get("count") or 0)
        prev = str(segment.get("hash", ""))
    if len(segments) != ref.get("seq") or prev != ref.get("head"):
        problems.append(f"chain of link {link}: its head is not the one the record names (a segment dropped or added)")
    if total != ref.get("count"):
        problems.append(f"chain of link {link}: holds {total} calls, the record names {ref.get('count')}")
    return problems


def check_chains(refs: Sequence[Mapping[str, Any]], chains: Mapping[str, Sequence[tuple[Mapping[str, Any], str]]],
                 signers: Mapping[str, Any] | None) -> list[str]:
    """Every chain a record names, against its segments (link -> segments with their recomputed hashes)."""
    problems: list[str] = []
    for ref in refs:
        problems += _chain_problems(ref, chains.get(str(ref.get("link")), ()), signers)
    return problems


def check_served(record: Mapping[str, Any], signers: Mapping[str, Any] | None) -> list[str]:
    """The segments of a served record of form 2: each segment's hash over its calls (``calls_from``), its
    signature, the chain's links, the head and count the record names; and the expanded calls in the
    record's order. Nothing for a record without segments."""
    from .termination import encode_entry, in_order_key

    if "segments" not in record:
        return []
    if not served(record):
        return ["the record names segments but does not carry them (serve it from GET /v1/records)"]
    if not well_formed(record):
        return ["the record's segments, sealed or calls_from are malformed"]
    calls = list(record.get("calls") or [])
    sealed = list(record.get("sealed") or [])
    sources = list(sources_of(record["calls_from"]))
    if len(sources) != len(calls) or any(s != OWN and not 0 <= s < len(sealed) for s in sources):
        return ["calls_from does not match the record's calls"]
    named = {str(ref.get("link")) for ref in record["segments"]}
    strays = sorted({str(s.get("link"))[:16] for s in sealed if str(s.get("link")) not in named})
    if strays:  # its calls would be covered by neither the record's hash nor a chain it names: made up
        return [f"sealed holds a segment of link {link}, a chain the record does not name" for link in strays]
    texts: dict[int, list[str]] = {i: [] for i in range(len(sealed))}
    for call, source in zip(calls, sources, strict=True):
        if source != OWN:
            texts[source].append(encode_entry(call))
    chains: dict[str, list[tuple[Mapping[str, Any], str]]] = {}
    for i, segment in enumerate(sealed):
        header = {k: v for k, v in segment.items() if k not in ("hash", "signature")}
        chains.setdefault(str(segment.get("link")), []).append((segment, segment_hash(header, texts[i])))
    problems = check_chains(record["segments"], chains, signers)
    reported = [in_order_key(c) for c in calls if isinstance(c, dict) and c.get("reported", True) is not False]
    if reported != sorted(reported):
        problems.append("the record's calls are not in the record's order")
    return problems


async def merged(own: Any, chains: Sequence[Any]) -> Any:
    """Async k-way merge of pages of (key, source, text) in key order: ``own``, the record's own reported calls
    and ``chains``, each chain's calls, every stream a page at a time in key order. Yields pages."""
    import heapq

    streams = [own, *chains]
    heads: list[tuple[Any, int, int, list[Any]]] = []  # (key, stream, index in page, page)
    for n, stream in enumerate(streams):
        page = await _next_page(stream)
        if page:
            heads.append((page[0][0], n, 0, page))
    heapq.heapify(heads)
    out: list[tuple[int, str]] = []
    while heads:
        _, n, i, page = heapq.heappop(heads)
        _, source, text = page[i]
        out.append((source, text))
        if i + 1 < len(page):
            heapq.heappush(heads, (page[i + 1][0], n, i + 1, page))
        else:
            nxt = await _next_page(streams[n])
            if nxt:
                heapq.heappush(heads, (nxt[0][0], n, 0, nxt))
        if len(out) >= 2000:
            yield out
            out = []
    if out:
        yield out


async def _next_page(stream: Any) -> list[Any]:
    try:
        return list(await anext(stream))
    except StopAsyncIteration:
        return []
