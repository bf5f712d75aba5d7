#!/usr/bin/env python3
"""A torch client of two ferryd with GPU arenas (make test-gpu).

It stages a bf16 embedding zero-copy on the sender: it asks for a slice,
opens the arena's CUDA IPC handle, writes the slice from torch in place and
commits it. The sender's ferryd sends it to a receive slot on the receiver;
the client then reads the slot in place on the receiver's GPU arena, and
once more as bytes over the socket, and compares both with what it wrote.

usage: torch_ipc.py SENDER_SOCKET RECEIVER_SOCKET
"""
import base64
import ctypes
import http.client
import json
import socket
import sys

import torch

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("ferryd", timeout=60)
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(self.unix_path)
        self.sock = s


def call(sock, method, path, body=None, raw=False):
    conn = UnixHTTPConnection(sock)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    if resp.status >= 300:
        sys.exit(f"FAIL: {method} {path} on {sock}: {resp.status} {out.decode(errors='replace')}")
    if raw:
        return out
    return json.loads(out) if out else None


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcMemHandle, ctypes.c_uint]
cuda.cuIpcOpenMemHandle_v2.restype = ctypes.c_int
cuda.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
cuda.cuIpcCloseMemHandle.restype = ctypes.c_int
cuda.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
cuda.cuCtxGetCurrent.restype = ctypes.c_int


def open_arena(ipc_b64):
    raw = base64.b64decode(ipc_b64)
    if len(raw) != 64:
        sys.exit(f"FAIL: an IPC handle of {len(raw)} bytes")
    h = IpcMemHandle()
    ctypes.memmove(ctypes.addressof(h), raw, 64)
    ptr = ctypes.c_uint64()
    rc = cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    if rc != 0:
        sys.exit(f"FAIL: cuIpcOpenMemHandle returned CUresult {rc}")
    return ptr.value


class DeviceBytes:
    """n bytes of device memory at ptr, for torch.as_tensor (no copy)."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    snd, rcv = sys.argv[1], sys.argv[2]
    st = call(snd, "GET", "/v1/status")
    if st["memory"]["kind"] != "cuda":
        sys.exit(f"FAIL: the sender's arena is {st['memory']['kind']} memory, not cuda")
    dev = torch.device(st["memory"]["device"])
    # torch's first CUDA op makes the device's primary context current on
    # this thread; the IPC calls below run in it.
    emb = torch.randn(16, 4096, dtype=torch.bfloat16, device=dev)
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        sys.exit("FAIL: torch left no CUDA context current")
    want = emb.view(torch.uint8).flatten()
    n = want.numel()

    req = "torch-ipc-1"
    sl = call(snd, "POST", f"/v1/embeddings/{req}/slice", {"shape": [16, 4096], "dtype": "bf16"})
    base = open_arena(sl["ipc_handle"])
    view = torch.as_tensor(DeviceBytes(base + sl["offset"], n), device=dev)
    view.copy_(want)
    torch.cuda.synchronize(dev)
    del view
    call(snd, "POST", f"/v1/embeddings/{req}/commit", {"shape": [16, 4096], "dtype": "bf16"})
    print(f"staged {req} in place: {n} bytes at offset {sl['offset']} of the sender's GPU arena ({sl['device']})")

    slot = call(rcv, "POST", "/v1/receives", {"req_id": req, "nbytes": n})
    res = call(snd, "POST", f"/v1/embeddings/{req}/send",
               {"session": slot["session"], "buffer_address": slot["buffer_address"], "key": slot["key"]})
    print(f"sent: {res['nbytes']} bytes in {res['ms']:.2f} ms over {res['transport']}")

    info = call(rcv, "GET", f"/v1/receives/{req}?wait=30s&format=json")
    rbase = open_arena(info["ipc_handle"])
    got = torch.as_tensor(DeviceBytes(rbase + info["offset"], n), device=dev).clone()
    torch.cuda.synchronize(dev)
    in_place = torch.equal(got, want)
    over_socket = call(rcv, "GET", f"/v1/receives/{req}?wait=30s", raw=True) == bytes(want.cpu().tolist())
    call(rcv, "DELETE", f"/v1/receives/{req}")
    for p in (base, rbase):
        if cuda.cuIpcCloseMemHandle(p) != 0:
            sys.exit("FAIL: cuIpcCloseMemHandle")
    print(f"read in place from the receiver's GPU arena: {'equal' if in_place else 'DIFFERENT'}; "
          f"read over the socket: {'equal' if over_socket else 'DIFFERENT'}")
    if not (in_place and over_socket):
        sys.exit("FAIL: the embedding changed on the way")
    print("PASS")


if __name__ == "__main__":
    main()
