// A stand-in for libcuda.so.1 for tests on hosts without a GPU: it takes
// the real signatures (cuda.h's, with the versioned names), so the package's
// dlopen, symbol table, C helpers and per-device thread run for real. It
// is strict where the real driver is: memory calls need a current context
// on the calling thread. It is stricter in one way, to make the arena's
// set-up observable: copies into an allocation fail unless SYNC_MEMOPS was
// set on it. "Device memory" is host memory; make test-gpu runs the real
// driver.
//
// IPC works across processes as the real driver's does: each allocation
// is a memfd mapping, its handle names the owner's pid, the memfd's
// descriptor and the size, and cuIpcOpenMemHandle maps the owner's memfd
// (through /proc/<pid>/fd) at an address of the opener's own, once: a
// handle open already is refused (CUDA_ERROR_ALREADY_MAPPED) until it is
// closed, as a process may open one once per context.
//
// It has two GPUs, at PCI bus ids 0000:3b:00.0 and 0000:3c:00.0, unless
// FAKECUDA_BUS_IDS lists others (comma-separated, at most 8): one GPU
// each, so a test can lay them out as a fake sysfs tree does.
//
// cuPointerGetAttribute knows this process's allocations (and those it
// opened) as device memory on the GPU current when they were made;
// cuMemAllocAsync's (a stream-ordered pool's) have no IPC handle, as the
// real driver's have none of cuIpcGetMemHandle's kind.
//
// Variants, by macro: FAKE_NO_DEVICE (cuInit finds no GPU), FAKE_STUB
// (cuInit answers like the toolkit's stub library), FAKE_OLD (no
// cuMemGetHandleForAddressRange), FAKE_BROKEN (no cuMemHostAlloc).
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } ipc_handle;

enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, STUB = 34, NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_CONTEXT = 201, ALREADY_MAPPED = 208 };
enum { MAXDEV = 8, MAXALLOC = 64 };

static int inited, ndev = 2;
static unsigned bus_ids[MAXDEV][4] = {{0, 0x3b, 0, 0}, {0, 0x3c, 0, 0}}; // domain, bus, device, function
static int ctx_refs[MAXDEV];
static char ctxs[MAXDEV]; // a context is the address of its byte
static __thread void *current;

// An allocation of this process (fd its memfd), or another's opened by
// IPC handle (fd -1); len is its mapping's length, dev its GPU; pool
// marks cuMemAllocAsync's.
// from_pid, from_fd and from_p name the owner's allocation of one opened
// by IPC handle.
static struct alloc { char *p; size_t n, len; int fd, sync, dev, pool, from_pid, from_fd; CUdeviceptr from_p; } allocs[MAXALLOC];

// The handle: a mark, the owner's pid and memfd, the size, and (at the
// end, so the whole struct must arrive) the owner's pointer.
struct fake_ipc { char mark[8]; int pid, fd; size_t n, len; char pad[24]; CUdeviceptr p; };
_Static_assert(sizeof(struct fake_ipc) == sizeof(ipc_handle), "the handle's layout");

static const size_t ALIGN = 2 << 20; // the real driver's allocation granularity

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "CUDA_SUCCESS"; return OK;
	case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
	case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
	}
	return INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case INVALID_VALUE: *s = "invalid argument"; return OK;
	case INVALID_CONTEXT: *s = "invalid device context"; return OK;
	case NO_DEVICE: *s = "no CUDA-capable device is detected"; return OK;
	}
	return INVALID_VALUE;
}

CUresult cuInit(unsigned int flags) {
#if defined(FAKE_NO_DEVICE)
	return NO_DEVICE;
#elif defined(FAKE_STUB)
	return STUB;
#endif
	if (flags != 0) return INVALID_VALUE;
	const char *ids = getenv("FAKECUDA_BUS_IDS");
	if (ids && *ids) {
		int n = 0, used = 0;
		unsigned *b;
		while (n < MAXDEV && (b = bus_ids[n], sscanf(ids, "%x:%x:%x.%x%n", &b[0], &b[1], &b[2], &b[3], &used) == 4)) {
			n++;
			ids += used;
			if (*ids != ',') break;
			ids++;
		}
		if (n == 0 || *ids) return INVALID_VALUE; // a list the fake cannot read
		ndev = n;
	}
	inited = 1;
	return OK;
}

CUresult cuDriverGetVersion(int *v) { *v = 12040; return OK; }

CUresult cuDeviceGetCount(int *n) {
	if (!inited) return NOT_INITIALIZED;
	*n = ndev;
	return OK;
}

CUresult cuDeviceGet(int *d, int ordinal) {
	if (ordinal < 0 || ordinal >= ndev) return INVALID_DEVICE;
	*d = ordinal;
	return OK;
}

CUresult cuDeviceGetName(char *name, int len, int d) {
	snprintf(name, len, "Fake GPU %d", d);
	return OK;
}

CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int d) {
	for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(d * 16 + i);
	return OK;
}

// The driver writes an 8-digit domain in upper case.
CUresult cuDeviceGetPCIBusId(char *id, int len, int d) {
	if (d < 0 || d >= ndev) return INVALID_DEVICE;
	unsigned *b = bus_ids[d];
	snprintf(id, len, "%08X:%02X:%02X.%X", b[0], b[1], b[2], b[3]);
	return OK;
}

CUresult cuDeviceTotalMem_v2(size_t *n, int d) { *n = (size_t)1 << 30; return OK; }

CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
	switch (attr) {
	case 41: *v = 1; return OK;  // unified addressing
	case 102: *v = 1; return OK; // VMM
	case 116: *v = 0; return OK; // GPUDirect RDMA
	case 124: *v = 1; return OK; // dmabuf
	}
	return INVALID_VALUE;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) {
	if (d < 0 || d >= ndev) return INVALID_DEVICE;
	ctx_refs[d]++;
	*ctx = &ctxs[d];
	return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(int d) {
	if (d < 0 || d >= ndev || ctx_refs[d] == 0) return INVALID_CONTEXT;
	ctx_refs[d]--;
	return OK;
}

CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }

// find returns the allocation holding [p, p+n) (for n 0, the byte at
// p: an allocation ending at p, which a mapping placed right after it
// would begin at, does not hold it), or NULL.
static struct alloc *find(CUdeviceptr p, size_t n) {
	for (int i = 0; i < MAXALLOC; i++) {
		struct alloc *a = &allocs[i];
		CUdeviceptr start = (CUdeviceptr)a->p, end = start + a->n;
		if (a->p && p >= start && p < end && p + n <= end) return a;
	}
	return NULL;
}

static struct alloc *free_entry(void) {
	for (int i = 0; i < MAXALLOC; i++)
		if (!allocs[i].p) return &allocs[i];
	return NULL;
}

// An allocation is a memfd, shared so another process can map it, at a
// 2 MiB-aligned address: mapped over a reservation one alignment longer,
// whose ends are then trimmed.
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = free_entry();
	if (!a || n == 0) return n == 0 ? INVALID_VALUE : 2;
	size_t len = (n + ALIGN - 1) / ALIGN * ALIGN;
	int fd = memfd_create("fakecuda", MFD_CLOEXEC);
	if (fd < 0) return 2;
	char *r = ftruncate(fd, len) == 0 ? mmap(NULL, len + ALIGN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0) : MAP_FAILED;
	if (r == MAP_FAILED) {
		close(fd);
		return 2;
	}
	char *at = (char *)(((uintptr_t)r + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
	if (mmap(at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
		munmap(r, len + ALIGN);
		close(fd);
		return 2;
	}
	if (at > r) munmap(r, at - r);
	if (r + ALIGN > at) munmap(at + len, r + ALIGN - at);
	*a = (struct alloc){.p = at, .n = n, .len = len, .fd = fd, .dev = (char *)current - ctxs};
	*p = (CUdeviceptr)at;
	return OK;
}

// Memory from the current device's stream-ordered pool: the stream is
// not looked at (every copy here is synchronous).
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *stream) {
	CUresult r = cuMemAlloc_v2(p, n);
	if (r == OK) find(*p, 0)->pool = 1;
	return r;
}

// The attributes ferry's Python package asks of a pointer: its memory
// type (CU_MEMORYTYPE_DEVICE for an allocation here) and its GPU.
CUresult cuPointerGetAttribute(void *value, int attr, CUdeviceptr p) {
	struct alloc *a = find(p, 0);
	if (!a) return INVALID_VALUE; // as the real driver answers for host memory it does not know
	switch (attr) {
	case 2: *(unsigned int *)value = 2; return OK; // MEMORY_TYPE: DEVICE
	case 9: *(int *)value = a->dev; return OK;     // DEVICE_ORDINAL
	}
	return INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(p, 0);
	if (!a || (CUdeviceptr)a->p != p || a->fd < 0) return INVALID_VALUE;
	munmap(a->p, a->len);
	close(a->fd);
	a->p = NULL;
	return OK;
}

CUresult cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(p, 0);
	if (attr != 6 || !a || *(const unsigned int *)value != 1) return INVALID_VALUE;
	a->sync = 1;
	return OK;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(dst, n);
	if (!a || !a->sync) return INVALID_VALUE;
	memcpy((void *)dst, src, n);
	return OK;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	if (!current) return INVALID_CONTEXT;
	if (!find(src, n)) return INVALID_VALUE;
	memcpy(dst, (void *)src, n);
	return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(p, 0);
	if (!a) return INVALID_VALUE;
	*base = (CUdeviceptr)a->p;
	*size = a->n;
	return OK;
}

CUresult cuIpcGetMemHandle(ipc_handle *h, CUdeviceptr p) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(p, 0);
	if (!a || a->fd < 0 || a->pool) return INVALID_VALUE; // memory opened by IPC is not exported again, pool memory never
	struct fake_ipc f = {.mark = "fakeipc", .pid = getpid(), .fd = a->fd, .n = a->n, .len = a->len, .p = (CUdeviceptr)a->p};
	memcpy(h, &f, sizeof f);
	return OK;
}

// Another process's handle maps its memfd here, at an address of this
// process's own. The real driver refuses a process its own handles; the
// fake hands back the allocation, to show in one process that the handle
// crossed by value intact.
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, ipc_handle h, unsigned int flags) {
	if (!current) return INVALID_CONTEXT;
	struct fake_ipc f;
	memcpy(&f, &h, sizeof f);
	if (flags != 1 || memcmp(f.mark, "fakeipc", 8) != 0) return INVALID_VALUE;
	if (f.pid == getpid()) {
		*p = f.p;
		return OK;
	}
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].p && allocs[i].fd < 0 && allocs[i].from_pid == f.pid && allocs[i].from_fd == f.fd &&
		    allocs[i].from_p == f.p)
			return ALREADY_MAPPED;
	struct alloc *a = free_entry();
	if (!a) return 2;
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/fd/%d", f.pid, f.fd);
	int fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0) return INVALID_VALUE; // the owner is gone
	char *m = mmap(NULL, f.len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return INVALID_VALUE;
	*a = (struct alloc){.p = m, .n = f.n, .len = f.len, .fd = -1, .sync = 1, .dev = (char *)current - ctxs, .from_pid = f.pid, .from_fd = f.fd, .from_p = f.p};
	*p = (CUdeviceptr)m;
	return OK;
}

// It unmaps another process's memory; this process's own (opened by its
// own handle) stays.
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	if (!current) return INVALID_CONTEXT;
	struct alloc *a = find(p, 0);
	if (!a || (CUdeviceptr)a->p != p) return INVALID_VALUE;
	if (a->fd < 0) {
		munmap(a->p, a->len);
		a->p = NULL;
	}
	return OK;
}

#ifndef FAKE_BROKEN
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
	if (!current) return INVALID_CONTEXT;
	if (flags != 0) return INVALID_VALUE;
	*p = malloc(n);
	return *p ? OK : 2;
}
#endif

CUresult cuMemFreeHost(void *p) {
	if (!current) return INVALID_CONTEXT;
	free(p);
	return OK;
}

#ifndef FAKE_OLD
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
	if (!current) return INVALID_CONTEXT;
	if (type != 1 || flags != 0 || !find(p, n) || p % 4096 || n % 4096) return INVALID_VALUE;
	*(int *)handle = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return OK;
}
#endif
