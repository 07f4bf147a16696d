"""A kernel-side socket-to-socket redirect with eBPF sockhash for bench_stream.py's sockmap relay (issue 28 item 4).

No compiler: the one program is a hand-assembled eBPF instruction array, loaded with ``BPF_PROG_LOAD`` through
ctypes. It is an ``sk_skb`` verdict program attached to a ``BPF_MAP_TYPE_SOCKHASH``: every socket in the map has its
received data handed to the program, skb by skb, before any reader sees it. The map is keyed by socket cookie
(``SO_COOKIE``): the entry under a socket's own cookie is the socket its data goes to. A second map (a hash, the
same keys) holds each socket's byte budget: the program redirects an skb to the peer's send side only while the
whole skb fits in what is left of the budget (and takes it off), and passes every skb from the first one that does
not (``SK_PASS``: the receiving socket's own queue, read by whoever reads the socket, as without the map). A socket
without a budget entry, or with an entry at 0, passes everything; an skb within budget whose socket has no peer in
the map is dropped (``bpf_sk_redirect_hash`` answers SK_DROP).

Two things the kernel (6.18) does that a user must know, both found with this module (bench/RESULTS.md, "Streams:
a sockmap relay against the splice relay"): bytes already queued on a socket when it joins the map are not run
through the verdict until more arrive (``setsockopt(SO_RCVLOWAT)`` runs ``tcp_data_ready()`` and with it the
verdict at once); and if the socket's reader had already taken part of the first queued skb, the whole skb is
redirected, the part already read included: those bytes reach the peer twice.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass

SYS_BPF = 321  # x86_64
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM = 0, 1, 2, 3
BPF_PROG_LOAD, BPF_PROG_ATTACH, BPF_PROG_DETACH = 5, 8, 9
BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_SOCKHASH = 1, 18
BPF_PROG_TYPE_SK_SKB = 14
BPF_SK_SKB_STREAM_VERDICT, BPF_SK_SKB_VERDICT = 5, 38
BPF_F_NO_PREALLOC = 1
SO_COOKIE = 57
ATTR_SIZE = 144  # sizeof(union bpf_attr)

# sk_skb program: helpers and __sk_buff offsets (include/uapi/linux/bpf.h)
FUNC_MAP_LOOKUP_ELEM, FUNC_GET_SOCKET_COOKIE, FUNC_SK_REDIRECT_HASH = 1, 46, 72
SKB_LEN = 0
SK_DROP, SK_PASS = 0, 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfError(OSError):
    """The kernel refused a bpf(2) command."""


def bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr.ljust(ATTR_SIZE, b"\0"), ATTR_SIZE)
    ret = _libc.syscall(SYS_BPF, cmd, buf, ATTR_SIZE)
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


def map_create(map_type: int, key_size: int, value_size: int, entries: int, flags: int = 0) -> int:
    return bpf(BPF_MAP_CREATE, struct.pack("IIIII", map_type, key_size, value_size, entries, flags))


def _ptr(buf: ctypes.Array) -> int:
    return ctypes.addressof(buf)


def map_update(map_fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", map_fd, 0, _ptr(k), _ptr(v), flags))


def map_lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, struct.pack("IIQQQ", map_fd, 0, _ptr(k), _ptr(v), 0))
    except BpfError as e:
        if e.errno == 2:  # ENOENT
            return None
        raise
    return v.raw


def map_delete(map_fd: int, key: bytes) -> bool:
    k = ctypes.create_string_buffer(key, len(key))
    try:
        bpf(BPF_MAP_DELETE_ELEM, struct.pack("IIQ", map_fd, 0, _ptr(k)))
    except BpfError as e:
        if e.errno == 2:
            return False
        raise
    return True


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


def ld_map_fd(dst: int, fd: int) -> bytes:
    return insn(0x18, dst, 1, 0, fd) + insn(0, 0, 0, 0, 0)  # BPF_LD|BPF_DW|BPF_IMM, src BPF_PSEUDO_MAP_FD


def verdict_program(sockhash_fd: int, budget_fd: int) -> bytes:
    """The verdict: cookie = the receiving socket's; budget = budget[cookie]; if the skb fits in it, take it off
    and redirect to sockhash[cookie]'s send side; else SK_PASS."""
    MOV_X, MOV_K, LDX_W, LDX_DW, STX_DW, ADD_K = 0xBF, 0xB7, 0x61, 0x79, 0x7B, 0x07
    JEQ_K, JGT_X, CALL, EXIT, ATOMIC_DW = 0x15, 0x2D, 0x85, 0x95, 0xDB
    prog = [
        insn(MOV_X, 6, 1),                                  # r6 = ctx
        insn(CALL, imm=FUNC_GET_SOCKET_COOKIE),             # r0 = cookie(ctx)
        insn(STX_DW, 10, 0, -8),                            # *(u64 *)(fp - 8) = cookie
        ld_map_fd(1, budget_fd),                            # r1 = budget map
        insn(MOV_X, 2, 10), insn(ADD_K, 2, imm=-8),         # r2 = &cookie
        insn(CALL, imm=FUNC_MAP_LOOKUP_ELEM),               # r0 = &budget[cookie] or NULL
        insn(JEQ_K, 0, off=14, imm=0),                      # no entry: pass
        insn(LDX_DW, 7, 0, 0),                              # r7 = budget
        insn(LDX_W, 8, 6, SKB_LEN),                         # r8 = skb->len
        insn(JGT_X, 8, 7, off=11),                          # len > budget: pass (a budget at 0 passes all)
        insn(MOV_K, 9, imm=0), insn(0x1F, 9, 8),            # r9 = -len
        insn(ATOMIC_DW, 0, 9, 0, 0x00),                     # budget[cookie] += -len (atomic add)
        insn(MOV_X, 1, 6),                                  # r1 = ctx
        ld_map_fd(2, sockhash_fd),                          # r2 = sockhash
        insn(MOV_X, 3, 10), insn(ADD_K, 3, imm=-8),         # r3 = &cookie
        insn(MOV_K, 4, imm=0),                              # r4 = 0: the peer's send side
        insn(CALL, imm=FUNC_SK_REDIRECT_HASH),              # r0 = SK_PASS (redirected) or SK_DROP (no peer)
        insn(EXIT),
        insn(MOV_K, 0, imm=SK_PASS),                        # pass:
        insn(EXIT),
    ]
    return b"".join(prog)


def prog_load(prog_type: int, code: bytes, expected_attach: int = 0) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags, prog_name[16],
    # prog_ifindex, expected_attach_type
    attr = struct.pack("IIQQIIQII16sII", prog_type, len(code) // 8, _ptr(insns), _ptr(lic), 1, len(log), _ptr(log),
                       0, 0, b"tether_relay", 0, expected_attach)
    try:
        return bpf(BPF_PROG_LOAD, attr)
    except BpfError as e:
        raise BpfError(e.errno, f"BPF_PROG_LOAD: {os.strerror(e.errno or 0)}: {log.value.decode(errors='replace')}")\
            from None


def prog_attach(target_fd: int, prog_fd: int, attach_type: int) -> None:
    bpf(BPF_PROG_ATTACH, struct.pack("IIII", target_fd, prog_fd, attach_type, 0))


def cookie(sock: socket.socket | int) -> bytes:
    """The socket's cookie (SO_COOKIE), as the map keys hold it."""
    if isinstance(sock, socket.socket):
        return sock.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8)
    s = socket.socket(fileno=sock)
    try:
        return s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8)
    finally:
        s.detach()


@dataclass
class Redirector:
    """A sockhash, its budgets and the verdict program attached to it: pairs of sockets whose received bytes the
    kernel moves to the other's send side, up to each socket's budget."""

    sockhash: int
    budgets: int
    prog: int

    @classmethod
    def create(cls, entries: int = 4096, attach_type: int = BPF_SK_SKB_VERDICT) -> Redirector:
        sockhash = map_create(BPF_MAP_TYPE_SOCKHASH, 8, 8, entries)
        fds = [sockhash]
        try:
            budgets = map_create(BPF_MAP_TYPE_HASH, 8, 8, entries, BPF_F_NO_PREALLOC)
            fds.append(budgets)
            prog = prog_load(BPF_PROG_TYPE_SK_SKB, verdict_program(sockhash, budgets), attach_type)
            fds.append(prog)
            prog_attach(sockhash, prog, attach_type)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(sockhash, budgets, prog)

    def close(self) -> None:
        for fd in (self.prog, self.budgets, self.sockhash):
            os.close(fd)

    def set_budget(self, sock: socket.socket | int, budget: int) -> None:
        map_update(self.budgets, cookie(sock), struct.pack("<Q", budget))

    def budget(self, sock: socket.socket | int) -> int | None:
        value = map_lookup(self.budgets, cookie(sock), 8)
        return None if value is None else struct.unpack("<Q", value)[0]

    def join(self, a: socket.socket | int, b: socket.socket | int) -> None:
        """a's received data goes to b, b's to a (each within its budget)."""
        fa, fb = (s if isinstance(s, int) else s.fileno() for s in (a, b))
        map_update(self.sockhash, cookie(fa), struct.pack("<Q", fb))
        map_update(self.sockhash, cookie(fb), struct.pack("<Q", fa))

    def part(self, *socks: socket.socket | int) -> None:
        for s in socks:
            key = cookie(s)
            map_delete(self.sockhash, key)
            map_delete(self.budgets, key)
