"""``tether records checkpoint|prove|verify --checkpoint|verify-one``: the record log checked by someone who
trusts only the control plane's public key (and, if they like, witnesses' keys)."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

from tether.capability.errors import BAD_REQUEST, USAGE, TetherError


def read_json(path: str, what: str, kind: type) -> Any:
    """A JSON file the user named, of the kind expected (a list of records, one record, a proof), or
    ``tether.bad_request`` naming the file and what is wrong with it."""
    from tether.capability.shared import read_file

    try:
        value = json.loads(read_file(path, what))
    except ValueError as exc:
        raise TetherError(f"{what} {path} is not JSON: {exc}", code=BAD_REQUEST) from None
    if not isinstance(value, kind):
        expected = "a list" if kind is list else "an object"
        raise TetherError(f"{what} {path}: expected {expected}, got {type(value).__name__}", code=BAD_REQUEST)
    return value


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def log_verifier(note: str, public: Any) -> Any:
    """The checkpoint's signer: the key ``public`` under the name the checkpoint's origin gives."""
    from tether.controlplane.notes import Verifier

    return Verifier(note.split("\n", 1)[0], public)


def cmd_checkpoint(args: argparse.Namespace, c: Any, public: Any) -> int:
    note = c.request("GET", "/v1/records/checkpoint", admin=False)
    if args.vkey:
        print(log_verifier(note, public).vkey())  # what a witness is given (tether witness serve --log)
    else:
        sys.stdout.write(note)
    return 0


def cmd_prove(args: argparse.Namespace, c: Any) -> int:
    from urllib.parse import urlencode

    if not args.id:
        raise TetherError("records prove needs the record's ID", code=USAGE)
    query = {"record": args.id, **({"size": args.size} if args.size is not None else {})}
    print(json.dumps(c.request("GET", f"/v1/records/proof/inclusion?{urlencode(query)}"), indent=2))
    return 0


def check_against(records: list[dict[str, Any]], note: str, public: Any, witness_keys: list[str]) -> list[str]:
    """What is wrong with ``records`` as the log ``note`` commits to (empty: exactly its first ``size``)."""
    from tether.controlplane.merkle import Tree, record_leaf
    from tether.controlplane.notes import NoteError, open_checkpoint, parse_vkey, verify_cosignature

    try:
        checkpoint, parsed = open_checkpoint(note, log_verifier(note, public))
    except NoteError as exc:
        return [f"the checkpoint: {exc}"]
    problems = []
    for text in witness_keys:
        try:
            verify_cosignature(parsed, parse_vkey(text))
        except NoteError as exc:
            problems.append(f"witness: {exc}")
    if len(records) < checkpoint.size:
        problems.append(f"the log holds {len(records)} record(s) but the checkpoint commits to {checkpoint.size}: "
                        f"its last {checkpoint.size - len(records)} are missing (a dropped tail)")
        return problems
    tree = Tree([record_leaf(str(r.get("hash", ""))) for r in records])
    if tree.root(checkpoint.size) != checkpoint.root:
        problems.append(f"the first {checkpoint.size} record(s) are not the log the checkpoint commits to "
                        "(a record rewritten, removed, inserted or reordered, or a fork)")
    return problems


def cmd_verify_one(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.shared import read_file
    from tether.controlplane.merkle import record_leaf, verify_inclusion
    from tether.controlplane.notes import NoteError, open_checkpoint
    from tether.controlplane.segments import check_served
    from tether.controlplane.termination import record_hash

    if not (args.id and args.proof and args.checkpoint and args.trust):
        raise TetherError("records verify-one needs RECORD.json, --proof P, --checkpoint C and --trust F.pub",
                          code=USAGE)
    record = read_json(args.id, "record", dict)
    proof = read_json(args.proof, "proof", dict)
    note = read_file(args.checkpoint, "checkpoint").decode()
    public = keys.load_public(read_file(args.trust, "trust key"), args.trust)
    problems = []
    try:
        checkpoint, _ = open_checkpoint(note, log_verifier(note, public))
    except NoteError as exc:
        return _verdict(args, [f"the checkpoint: {exc}"], record, None, None)
    if record_hash(record) != record.get("hash"):
        problems.append("the record's content does not match its hash (edited)")
    # A record of form 2 (as served): every segment it names. Not their signatures: the record is trusted by its
    # hash (in the checkpointed log), which pins each segment, and a segment sealed before a key rotation is
    # signed by a key this one record cannot name.
    problems += check_served(record, None)
    if proof.get("size") != checkpoint.size:
        problems.append(f"the proof is for a log of {proof.get('size')} records, the checkpoint of {checkpoint.size}")
    elif not verify_inclusion(record_leaf(str(record.get("hash", ""))), int(proof.get("index", -1)), checkpoint.size,
                              [_b64(h) for h in proof.get("proof", [])], checkpoint.root):
        problems.append("the inclusion proof does not put this record in the log the checkpoint commits to")
    return _verdict(args, problems, record, proof, checkpoint)


def _verdict(args: argparse.Namespace, problems: list[str], record: dict[str, Any], proof: dict[str, Any] | None,
             checkpoint: Any) -> int:
    """verify-one's answer: text, or ``--json``; exit 0 when the record is in the log, 1 otherwise."""
    if getattr(args, "json", False):
        print(json.dumps({"ok": not problems, "record_id": record.get("record_id"), "problems": problems,
                          "index": proof.get("index") if proof else None,
                          "size": checkpoint.size if checkpoint else None,
                          "origin": checkpoint.origin if checkpoint else None}, indent=2, sort_keys=True))
        return 0 if not problems else 1
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    print(f"ok: record {record.get('record_id')} is record {proof['index'] if proof else '?'} of the "
          f"{checkpoint.size} the checkpoint of {checkpoint.origin} commits to")
    return 0
