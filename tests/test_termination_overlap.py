"""Overlapping terminations, pure: a call belongs to exactly one record (``tether/controlplane/termination.py``).

A parent's subtree holds its child, so terminating both at once puts the child's calls under two
terminations. The model below drives the real ``build_record`` / ``build_addendum`` / ``seal`` over every
interleaving hypothesis finds of: calls starting and ending, runs acknowledging one termination or another,
and each termination's driver building its record or addendum on the log as it is and appending it only if
the log's head has not moved meanwhile (the store's compare-and-set: two replicas writing at once). After
every append, and once everyone has acknowledged and every driver has nothing left to write:

- no call is held as reported by two records (addenda included), nor twice by one;
- a record reporting calls that an earlier record of another termination listed as ``unknown`` (its agent
  unaccounted there) names that record in ``accounts_for``, with exactly those calls, and the agents of its
  ``agents_unaccounted`` it confirms; ``calls_held_by`` names only earlier records;
- in the end every reported call is held as reported by exactly one record, every termination's last word
  confirms all its agents, and the hash chain verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.controlplane import termination as proto

Doc = dict[str, Any]
T0 = 1_750_000_000.0
KEY = keys.generate()
SUBTREE = {"p": ("p", "c", "g"), "c": ("c", "g"), "g": ("g",)}  # p delegated c, c delegated g


@dataclass
class Fleet:
    """Agents with one sidecar run each, the reports and starts the store holds, and the record log."""

    subjects: list[str]
    terms: dict[str, Doc] = field(default_factory=dict)
    runs: dict[str, Doc] = field(default_factory=dict)
    acks: dict[str, dict[str, Doc]] = field(default_factory=dict)
    reports: list[Doc] = field(default_factory=list)
    log: list[Doc] = field(default_factory=list)
    pending: dict[str, Doc] = field(default_factory=dict)  # tid -> built on some head, not appended yet
    calls: int = 0
    refused: int = 0  # builds dropped because the log's head moved (another driver appended first)
    now: float = T0

    def __post_init__(self) -> None:
        for agent in SUBTREE["p"]:
            self.runs[agent] = {"run_id": f"run-{agent}", "agent": agent, "link": f"h-{agent}", "inflight": [],
                                "last_seen": T0, "lease_expires": T0 + 15, "final": None}
        for subject in self.subjects:
            tid = f"term-{subject}"
            doc = proto.new_termination(tid, subject, "drain", 2.0, "overlap", "admin", T0, SUBTREE[subject], 2.0)
            self.terms[tid] = doc
            self.acks[tid] = {}

    def tick(self) -> float:
        self.now += 0.1
        return self.now

    # -- what sidecars do ---------------------------------------------------------------------------------
    def begin(self, agent: str) -> None:
        run = self.runs[agent]
        if run["final"] is None:
            self.calls += 1
            run["inflight"].append({"call_id": f"c{self.calls:03d}-{agent}", "agent": agent,
                                    "capability": "issues.read", "method": "GET", "url": "http://t/",
                                    "started_at": self.tick(), "phase": "forwarded"})

    def end(self, agent: str, resolution: str = "completed") -> None:
        run = self.runs[agent]
        if run["inflight"] and run["final"] is None:
            call = run["inflight"].pop(0)
            self.reports.append({**{k: call[k] for k in ("call_id", "agent", "capability", "method", "url",
                                                          "started_at")},
                                 "resolution": resolution, "status": 200 if resolution == "completed" else None,
                                 "link": run["link"], "run_id": run["run_id"], "ended_at": self.tick()})

    def ack(self, agent: str, tid: str) -> None:
        """A run quiesces (its calls in flight end, reported before the acknowledgement, as a sidecar does)
        and acknowledges ``tid``; a run already quiesced acknowledges at once."""
        if agent not in self.terms[tid]["agents"]:
            return
        run = self.runs[agent]
        while run["inflight"]:
            self.end(agent, "unknown")
        run["final"], run["final_at"] = "terminated", self.tick()
        self.acks[tid][run["run_id"]] = {"at": self.now, "state": "terminated", "agent": agent}

    # -- what each termination's driver does --------------------------------------------------------------
    def of(self, tid: str) -> list[Doc]:
        return [r for r in self.log if r["termination_id"] == tid]

    def build(self, tid: str) -> None:
        """What the driver would append now: the record, or an addendum once an open agent is accounted."""
        doc = self.terms[tid]
        runs = [self.runs[a] for a in doc["agents"]]
        head = self.log[-1]["hash"] if self.log else ""
        rid = f"rec-{len(self.log)}-{tid}"
        reports = [r for r in self.reports if r["agent"] in doc["agents"]]
        if not self.of(tid):
            ended = {r["call_id"] for r in self.reports}
            starts = [c for a in doc["agents"] for c in self.runs[a]["inflight"] if c["call_id"] not in ended]
            record: Doc | None = proto.build_record(doc, record_id=rid, reports=reports, links=[], revocations={},
                                                    runs=runs, acks=self.acks[tid], prev_hash=head, now=self.tick(),
                                                    starts=starts, log=list(self.log))
        else:
            record = proto.build_addendum(doc, list(self.log), record_id=rid, reports=reports, runs=runs,
                                          acks=self.acks[tid], prev_hash=head, now=self.tick())
        if record is not None:
            self.pending[tid] = proto.seal(record, KEY)

    def commit(self, tid: str) -> bool:
        """Append what was built, only on the head it was built on (else it is dropped: the driver rebuilds)."""
        record = self.pending.pop(tid, None)
        head = self.log[-1]["hash"] if self.log else ""
        if record is None or record["prev_hash"] != head:
            self.refused += record is not None
            return False
        self.log.append(record)
        check_one_owner(self.log)
        return True

    def settle(self) -> None:
        """Everyone acknowledges every termination of theirs; each driver writes until it has nothing to add."""
        for tid, doc in self.terms.items():
            for agent in doc["agents"]:
                self.ack(agent, tid)
        for round_ in range(6 * len(self.terms)):
            progressed = False
            if round_ % 2 == 0:  # every driver builds on the same head, then all try to append: one wins
                for tid in self.terms:
                    self.build(tid)
                for tid in self.terms:
                    progressed |= self.commit(tid)
            else:
                for tid in self.terms:
                    self.build(tid)
                    progressed |= self.commit(tid)
            if not progressed and not self.pending:
                return
        raise AssertionError("the drivers never stopped appending")

    def race(self, first: str, second: str) -> None:
        """Two drivers (two replicas) build on the same head and append one after the other."""
        self.build(first)
        self.build(second)
        self.commit(first)
        self.commit(second)


def reported(record: Doc) -> list[str]:
    return [c["call_id"] for c in record["calls"] if c.get("reported", True)]


def check_one_owner(log: list[Doc]) -> None:
    owners: dict[str, str] = {}
    for index, record in enumerate(log):
        mine = reported(record)
        assert len(mine) == len(set(mine)), f"{record['record_id']} lists a call twice"
        for call_id in mine:
            assert call_id not in owners, f"{call_id} reported in {owners.get(call_id)} and {record['record_id']}"
            owners[call_id] = record["record_id"]
        earlier = log[:index]
        earlier_ids = {r["record_id"] for r in earlier}
        confirmed = {(e["agent"], run) for e in record["agents_terminated"] for run in e["runs"]}
        links = {a["record_id"]: a for a in record.get("accounts_for", [])}
        assert set(links) <= earlier_ids and {h["record_id"] for h in record.get("calls_held_by", [])} <= earlier_ids
        assert all(h["termination_id"] != record["termination_id"] for h in record.get("calls_held_by", []))
        for other in earlier:
            if other["termination_id"] == record["termination_id"]:
                continue
            unknown = {c["call_id"] for c in other["calls"] if c.get("reported", True) is False}
            agents = {u["agent"] for u in other["agents_unaccounted"]
                      if {(u["agent"], r["run_id"]) for r in u["runs"]} & confirmed}
            took = unknown & set(mine)
            if took or agents:
                link = links.get(other["record_id"])
                assert link is not None, f"{record['record_id']} does not say it accounts for {other['record_id']}"
                assert (set(link["call_ids"]), set(link["agents"])) == (took, agents)
                assert link["termination_id"] == other["termination_id"]
            else:
                assert other["record_id"] not in links


STEP = st.one_of(
    st.tuples(st.just("begin"), st.sampled_from(SUBTREE["p"]), st.just(0)),
    st.tuples(st.just("end"), st.sampled_from(SUBTREE["p"]), st.just(0)),
    st.tuples(st.just("ack"), st.sampled_from(SUBTREE["p"]), st.integers(0, 2)),
    st.tuples(st.just("build"), st.just(""), st.integers(0, 2)),
    st.tuples(st.just("commit"), st.just(""), st.integers(0, 2)),
    st.tuples(st.just("race"), st.just(""), st.integers(0, 8)),  # which pair: which // 3, which % 3
)


@settings(max_examples=400, deadline=None)
@given(subjects=st.lists(st.sampled_from(sorted(SUBTREE)), min_size=2, max_size=3, unique=True),
       steps=st.lists(STEP, max_size=60))
def test_overlapping_terminations_give_every_call_exactly_one_record(subjects: list[str],
                                                                     steps: list[tuple[str, str, int]]) -> None:
    fleet = Fleet(subjects)
    tids = sorted(fleet.terms)
    for kind, agent, which in steps:
        tid = tids[which % len(tids)]
        if kind == "begin":
            fleet.begin(agent)
        elif kind == "end":
            fleet.end(agent)
        elif kind == "ack":
            fleet.ack(agent, tid)
        elif kind == "build":
            fleet.build(tid)
        elif kind == "race":
            fleet.race(tids[(which // 3) % len(tids)], tid)
        else:
            fleet.commit(tid)
    fleet.settle()
    check_one_owner(fleet.log)
    owners = proto.held_as_reported(fleet.log)
    covered = {a for doc in fleet.terms.values() for a in doc["agents"]}
    expected = {r["call_id"] for r in fleet.reports if r["agent"] in covered}
    assert set(owners) == expected, f"missing {sorted(expected - set(owners))}, extra {sorted(set(owners) - expected)}"
    for tid, doc in fleet.terms.items():
        last = fleet.of(tid)[-1]
        assert last["agents_unaccounted"] == [], f"{tid} still has {last['agents_unaccounted']}"
        assert set(doc["agents"]) <= {a for r in fleet.of(tid) for a in proto.terminated_agents(r)}
    assert proto.verify_records(fleet.log, KEY.public_key()).ok
    for name, seen in (("an addendum", any(r.get("amends") for r in fleet.log)),
                       ("accounts_for", any(r.get("accounts_for") for r in fleet.log)),
                       ("calls_held_by", any(r.get("calls_held_by") for r in fleet.log)),
                       ("a stale build refused", fleet.refused > 0)):
        event(f"{name}: {seen}")


# -- the case the issue saw: parent (window 2 s) and child (window 6 s) terminated at once ------------------
def parent_reconciles_before_the_child_acknowledges() -> Fleet:
    """The child's slow calls keep it draining past the parent's window: the parent's record lists the child
    unaccounted, its calls in flight as ``unknown``."""
    fleet = Fleet(["p", "c"])
    fleet.begin("c")
    fleet.end("c")  # reported before either record: the parent's record holds it
    fleet.begin("c")
    fleet.begin("c")  # in flight through the parent's window
    fleet.ack("p", "term-p")
    fleet.ack("g", "term-c")  # the grandchild had nothing in flight (its quiesced run speaks for it to both)
    fleet.build("term-p")
    assert fleet.commit("term-p")
    first = fleet.log[0]
    assert [u["agent"] for u in first["agents_unaccounted"]] == ["c"]
    assert [c["call_id"] for c in first["calls"] if c.get("reported") is False] == ["c002-c", "c003-c"]
    fleet.ack("c", "term-c")  # the child's calls end (reported) and it acknowledges both
    fleet.ack("c", "term-p")
    return fleet


def test_child_record_first_then_the_parents_addendum_repeats_nothing() -> None:
    fleet = parent_reconciles_before_the_child_acknowledges()
    fleet.build("term-c")
    assert fleet.commit("term-c")
    child = fleet.log[1]
    assert reported(child) == ["c002-c", "c003-c"]  # c001-c is the parent record's
    assert child["calls_held_by"] == [{"record_id": fleet.log[0]["record_id"], "termination_id": "term-p",
                                       "calls": 1}]
    assert child["accounts_for"] == [{"record_id": fleet.log[0]["record_id"], "termination_id": "term-p",
                                      "agents": ["c"], "call_ids": ["c002-c", "c003-c"]}]
    fleet.build("term-p")
    assert fleet.commit("term-p")
    addendum = fleet.log[2]
    assert addendum["amends"] == fleet.log[0]["record_id"] and proto.terminated_agents(addendum) == ["c"]
    assert addendum["calls"] == []  # before: the child's two calls again, reported in two records
    assert addendum["calls_held_by"] == [{"record_id": child["record_id"], "termination_id": "term-c", "calls": 2}]
    assert "accounts_for" not in addendum  # its own record is what it amends
    check_one_owner(fleet.log)


def test_parents_addendum_first_then_the_child_record_repeats_nothing() -> None:
    fleet = parent_reconciles_before_the_child_acknowledges()
    fleet.build("term-c")  # the child's driver builds on the log's head ...
    fleet.build("term-p")
    assert fleet.commit("term-p")  # ... the parent's addendum lands first ...
    assert not fleet.commit("term-c")  # ... so the child's record, built on the old head, is refused
    fleet.build("term-c")
    assert fleet.commit("term-c")
    addendum, child = fleet.log[1], fleet.log[2]
    assert reported(addendum) == ["c002-c", "c003-c"] and reported(child) == []
    assert [h["record_id"] for h in child["calls_held_by"]] == [fleet.log[0]["record_id"], addendum["record_id"]]
    assert "calls_held_by" not in addendum  # the calls it leaves out are in the record it amends
    check_one_owner(fleet.log)


def test_an_agent_id_granted_again_is_not_accounted_for_through_an_old_record() -> None:
    """An old termination left c's old run unaccounted; c re-granted runs anew and a later termination confirms
    the new run: that record accounts for nothing of the old one (same id, another run)."""
    fleet = Fleet(["c"])
    fleet.begin("c")
    fleet.build("term-c")
    assert fleet.commit("term-c")
    old = fleet.log[0]
    assert [u["agent"] for u in old["agents_unaccounted"]] == ["c", "g"]
    again = Fleet(["c"])
    again.runs["c"]["run_id"] = "run-c-again"
    again.ack("c", "term-c")
    again.ack("g", "term-c")
    doc = {**again.terms["term-c"], "id": "term-c-again"}
    record = proto.build_record(doc, record_id="rec-new", reports=[], links=[], revocations={},
                                runs=list(again.runs.values()), acks=again.acks["term-c"], prev_hash=old["hash"],
                                now=T0 + 60, log=[old])
    assert proto.terminated_agents(record) == ["c", "g"]
    assert record["accounts_for"] == [{"record_id": old["record_id"], "termination_id": "term-c",
                                       "agents": ["g"], "call_ids": []}]  # g's run is the same run; c's is not
