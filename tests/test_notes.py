"""Signed checkpoints as C2SP texts: notes (checked against the Go sumdb note package's published example),
checkpoints, and witnesses' cosignatures; every malformed or tampered form refused."""

from __future__ import annotations

import pytest

from tether.capability import keys
from tether.controlplane.notes import (
    COSIGNATURE_V1,
    DASH,
    Checkpoint,
    NoteError,
    Verifier,
    cosignature_line,
    open_checkpoint,
    parse_checkpoint,
    parse_note,
    parse_vkey,
    sign_note,
    signed_checkpoint,
    verify_cosignature,
    verify_note,
    with_lines,
)

# golang.org/x/mod/sumdb/note's example: a key, a text, and its signed note, byte for byte.
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
GO_NOTE = (GO_TEXT + f"\n{DASH} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfq"
           "dngotpRZb6KE6RyyBwJnAM=\n")


def test_the_go_note_example_verifies_and_any_change_to_it_does_not() -> None:
    verifier = parse_vkey(GO_VKEY)
    assert verifier.vkey() == GO_VKEY
    assert verify_note(GO_NOTE, verifier).text == GO_TEXT
    for tampered in (GO_NOTE.replace("answer", "Answer"), GO_NOTE.replace("x08go", "x08gO")):
        with pytest.raises(NoteError):
            verify_note(tampered, verifier)
    with pytest.raises(NoteError, match="no signature by"):
        verify_note(GO_NOTE, Verifier("Someone", verifier.public))


def test_a_checkpoint_signed_and_opened() -> None:
    key = keys.generate()
    checkpoint = Checkpoint("tether.example/records", 7, bytes(range(32)))
    note = signed_checkpoint(checkpoint, "tether.example/records", key)
    assert note.startswith("tether.example/records\n7\nAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\n\n")
    verifier = Verifier("tether.example/records", key.public_key())
    opened, _ = open_checkpoint(note, verifier)
    assert opened == checkpoint
    with pytest.raises(NoteError):
        open_checkpoint(note.replace("\n7\n", "\n8\n"), verifier)
    with pytest.raises(NoteError):
        open_checkpoint(note, Verifier("tether.example/records", keys.generate().public_key()))


@pytest.mark.parametrize("text", ["origin\n", "origin\n07\nAAAA\n", "origin\nx\n" + "A" * 44 + "\n",
                                  "\n1\n" + "A" * 43 + "=\n", "origin\n1\nAAAA\n", "origin\n1\n" + "A" * 43 + "="])
def test_malformed_checkpoints_are_refused(text: str) -> None:
    with pytest.raises(NoteError):
        parse_checkpoint(text)


@pytest.mark.parametrize("note", ["no blank line\n", "text\n\nnot a signature line\n", "text\n\n",
                                  f"text\n\n{DASH} name !!!\n", f"text\n\n{DASH} name AAAA\n",
                                  f"text\n\n\n{DASH} name AAAAAAAA\n"])
def test_malformed_notes_are_refused(note: str) -> None:
    with pytest.raises(NoteError):
        parse_note(note)


def test_a_witness_cosignature_names_its_time_and_covers_the_checkpoint() -> None:
    log_key, witness_key = keys.generate(), keys.generate()
    note = signed_checkpoint(Checkpoint("o", 3, b"\x01" * 32), "o", log_key)
    parsed = parse_note(note)
    line = cosignature_line(parsed.text, "witness.example", witness_key, 1_796_000_000)
    cosigned = parse_note(with_lines(note, [line]))
    witness = Verifier("witness.example", witness_key.public_key(), COSIGNATURE_V1)
    assert verify_cosignature(cosigned, witness) == 1_796_000_000
    assert witness.vkey().startswith("witness.example+") and parse_vkey(witness.vkey()) == witness
    other = parse_note(with_lines(signed_checkpoint(Checkpoint("o", 4, b"\x01" * 32), "o", log_key), [line]))
    with pytest.raises(NoteError, match="does not verify"):
        verify_cosignature(other, witness)  # a cosignature of size 3 does not cosign size 4
    with pytest.raises(NoteError):
        verify_cosignature(cosigned, Verifier("witness.example", witness_key.public_key()))  # not a 0x04 key
    with pytest.raises(NoteError):
        sign_note("two\n\nparagraphs\n", "o", log_key)
    with pytest.raises(NoteError):
        parse_vkey(witness.vkey().replace("+", "+0", 1))
