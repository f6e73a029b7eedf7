"""The simulated driver's private tables (cuGetExportTable), which NVIDIA's CUDA runtime needs
(shim/sim/cuda/exporttab.c, ctxstore.c, integrity.c): which tables answer, context-local storage
and its destructors at the context's end, and the integrity digest checked against an
independent HMAC-MD2 written here from RFC 1319 and RFC 2104. The runtime itself is the other
arbiter (tests/clients/test_cudart.py)."""

from __future__ import annotations

import textwrap
import uuid

from tests.sim.simhelp import run_python

RUNTIME = "6bd5fb6c-5bf4-e74a-8987-d93912fd9df9"
HOOKS = "a094798c-2e74-2e74-93f2-0800200c0a66"
TLS = "42d85a81-23f6-cb47-8298-f6e78a3aecdc"
CLS = "c693336e-1121-df11-a8c3-68f355d89593"
CHECKS = "263e8860-7cd2-6143-92f6-bbd5006dfa7e"
INTEGRITY = "d4082055-bde6-704b-8d34-ba123c66e1f2"
IDENTITY = "21318c60-9714-3248-8ca6-41ff7324c8f2"
SKIP_INIT_PROBE = "f8cff951-2146-8b4e-b9e2-fb469e7c0dd9"

# MD2's substitution table, RFC 1319 section 3.2 (from the digits of pi)
MD2_S = bytes(
    [
        41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199, 115, 140,
        152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66, 111, 24, 138, 23, 229, 18,
        190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47, 238, 122, 169, 104, 121, 145, 21, 178, 7, 63,
        148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93, 154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3,
        255, 25, 48, 179, 72, 165, 181, 209, 215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182,
        118, 252, 107, 226, 156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2,
        27, 96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81, 175, 58,
        195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205, 244, 65, 129, 77, 82,
        106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74, 120, 136, 149, 139, 227, 99, 232, 109,
        233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14, 102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10,
        49, 68, 80, 180, 143, 237, 31, 26, 219, 153, 141, 51, 159, 17, 131, 20,
    ]
)  # fmt: skip


def md2(data: bytes) -> bytes:
    pad = 16 - len(data) % 16
    msg = data + bytes([pad]) * pad
    c, last = bytearray(16), 0
    for i in range(0, len(msg), 16):
        for j in range(16):
            c[j] ^= MD2_S[msg[i + j] ^ last]
            last = c[j]
    msg += bytes(c)
    x = bytearray(48)
    for i in range(0, len(msg), 16):
        for j in range(16):
            x[16 + j] = msg[i + j]
            x[32 + j] = x[16 + j] ^ x[j]
        t = 0
        for r in range(18):
            for k in range(48):
                x[k] ^= MD2_S[t]
                t = x[k]
            t = (t + r) % 256
    return bytes(x[:16])


def hmac_md2(key: bytes, msg: bytes) -> bytes:
    inner = md2(bytes(b ^ 0x36 for b in key) + msg)
    return md2(bytes(b ^ 0x5C for b in key) + inner)


def test_md2_reference_vectors() -> None:
    # RFC 1319, appendix A.5
    assert md2(b"").hex() == "8350e5a3e24c153df2275c9f80692773"
    assert md2(b"abc").hex() == "da853b0d3f88d99b30283a69e6ded6bb"
    assert md2(b"message digest").hex() == "ab4f496bfb2a530b219ff33031fe06b0"


PROBE = """
import ctypes, os, struct, time, uuid
cu = ctypes.CDLL("libcuda.so.1")
def table(u):
    t = ctypes.c_void_p()
    rc = cu.cuGetExportTable(ctypes.byref(t), ctypes.c_char_p(uuid.UUID(u).bytes))
    return rc, t.value
out = {"probe_before_init": table(SKIP_INIT_PROBE)[0]}
assert cu.cuInit(0) == 0
for name, u in [("runtime", RUNTIME), ("hooks", HOOKS), ("tls", TLS), ("cls", CLS), ("checks", CHECKS),
                ("integrity", INTEGRITY), ("identity", IDENTITY), ("probe", SKIP_INIT_PROBE),
                ("unknown", "00000000-0000-0000-0000-000000000001")]:
    out[name] = table(u)
ptr = lambda base, i: ctypes.c_void_p.from_address(base + 8 * i).value
out["sizes"] = {n: ptr(out[n][1], 0) for n in ("runtime", "hooks", "tls", "integrity")}
# the runtime interface: slot 2 retains the primary context
ctx = ctypes.c_void_p()
retain = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)(ptr(out["runtime"][1], 2))
out["retain"] = retain(ctypes.byref(ctx), 0)
assert cu.cuCtxSetCurrent(ctx) == 0
# context-local storage: put, get, delete, miss; the destructor runs when the context ends
cls = out["cls"][1]
DTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
ran = []
dtor = DTOR(lambda c, k, v: ran.append((c, k, v)))
put = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, DTOR)(ptr(cls, 0))
delete = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(ptr(cls, 1))
get = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p)(ptr(cls, 2))
v = ctypes.c_void_p()
out["cls_miss"] = get(ctypes.byref(v), None, 0x10)
out["cls_put"] = [put(None, 0x10, 0x1234, dtor), put(ctx, 0x20, 0x5678, dtor)]
out["cls_get"] = [get(ctypes.byref(v), ctx, 0x10), v.value]
out["cls_delete"] = [delete(None, 0x20), get(ctypes.byref(v), None, 0x20)]
out["dtor_before_reset"] = len(ran)
assert cu.cuDevicePrimaryCtxReset_v2(0) == 0
out["dtor_after_reset"] = [[c == ctx.value, k, v] for c, k, v in ran]
# the integrity check: version ending in 2 is computed, 0 and 1 fixed words
ig = out["integrity"][1]
check = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64))(ptr(ig, 1))
res = (ctypes.c_uint64 * 2)()
now = int(time.time())
out["check_rc"] = check(13002, now, res)
out["digest"] = struct.pack("<QQ", res[0], res[1]).hex()
check(13000, now, res)
out["fixed0"] = [res[0], res[1]]
drv = ctypes.c_int()
cu.cuDriverGetVersion(ctypes.byref(drv))
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_ulong
uuid_bytes = (ctypes.c_char * 16)()
cu.cuDeviceGetUuid_v2(uuid_bytes, 0)
pci = []
for attr in (50, 33, 34):  # PCI domain, bus, device
    x = ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(x), attr, 0)
    pci.append(x.value)
msg = struct.pack("<IIIIQQQQ", drv.value, 13002, os.getpid(), libc.pthread_self() & 0xFFFFFFFF,
                  out["runtime"][1], ig, ptr(ig, 1), now) + bytes(uuid_bytes) + struct.pack("<iii", *pci)
out["message"] = msg.hex()
print(json.dumps(out))
"""


def test_private_tables_storage_and_integrity(sim_env: dict[str, str]) -> None:
    ids = {"RUNTIME": RUNTIME, "HOOKS": HOOKS, "TLS": TLS, "CLS": CLS, "CHECKS": CHECKS}
    ids.update(INTEGRITY=INTEGRITY, IDENTITY=IDENTITY, SKIP_INIT_PROBE=SKIP_INIT_PROBE)
    code = PROBE
    for name in sorted(ids, key=len, reverse=True):  # SKIP_INIT_PROBE before any shorter name
        code = code.replace(name, repr(ids[name]))
    got = run_python(sim_env, textwrap.dedent(code))
    assert got["probe_before_init"] == 500 and got["probe"][0] == 500  # CUDA_ERROR_NOT_FOUND
    for name in ("runtime", "hooks", "tls", "cls", "checks", "integrity", "identity"):
        assert got[name][0] == 0 and got[name][1], name
    assert got["unknown"] == [1, None]  # CUDA_ERROR_INVALID_VALUE, no table
    assert got["sizes"] == {"runtime": 13 * 8, "hooks": 7 * 8, "tls": 4 * 8, "integrity": 3 * 8}
    assert got["retain"] == 0
    assert got["cls_miss"] == 400  # CUDA_ERROR_INVALID_HANDLE: the runtime then creates its state
    assert got["cls_put"] == [0, 0] and got["cls_get"] == [0, 0x1234]
    assert got["cls_delete"] == [0, 400]
    assert got["dtor_before_reset"] == 0
    assert got["dtor_after_reset"] == [[True, 0x10, 0x1234]]  # the deleted entry's did not run
    assert got["check_rc"] == 0
    key = bytes.fromhex("146addae53a9a752aa0841360bf55a9f")
    assert got["digest"] == hmac_md2(key, bytes.fromhex(got["message"])).hex()
    assert got["fixed0"] == [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8]
    assert uuid.UUID(RUNTIME)  # the identifiers are well-formed
