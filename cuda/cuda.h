// The few CUDA driver API types ferry needs, declared here so that no CUDA
// header is needed to build, and one helper per call that calls through the
// function pointer dlsym returned. Each returns the call's CUresult.
#ifndef FERRY_CUDA_H
#define FERRY_CUDA_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

// CUipcMemHandle and CUuuid: opaque byte structs of these sizes.
typedef struct { char reserved[64]; } ferry_ipc_handle;
typedef struct { char bytes[16]; } ferry_uuid;

#define FERRY_POINTER_ATTRIBUTE_SYNC_MEMOPS 6
#define FERRY_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1
#define FERRY_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1

static inline CUresult ferry_cuGetErrorName(void *f, CUresult r, const char **s) {
	return ((CUresult (*)(CUresult, const char **))f)(r, s);
}
static inline CUresult ferry_cuGetErrorString(void *f, CUresult r, const char **s) {
	return ((CUresult (*)(CUresult, const char **))f)(r, s);
}
static inline CUresult ferry_cuInit(void *f, unsigned int flags) {
	return ((CUresult (*)(unsigned int))f)(flags);
}
static inline CUresult ferry_cuDriverGetVersion(void *f, int *v) {
	return ((CUresult (*)(int *))f)(v);
}
static inline CUresult ferry_cuDeviceGetCount(void *f, int *n) {
	return ((CUresult (*)(int *))f)(n);
}
static inline CUresult ferry_cuDeviceGet(void *f, CUdevice *d, int ordinal) {
	return ((CUresult (*)(CUdevice *, int))f)(d, ordinal);
}
static inline CUresult ferry_cuDeviceGetName(void *f, char *name, int len, CUdevice d) {
	return ((CUresult (*)(char *, int, CUdevice))f)(name, len, d);
}
static inline CUresult ferry_cuDeviceGetUuid(void *f, ferry_uuid *u, CUdevice d) {
	return ((CUresult (*)(ferry_uuid *, CUdevice))f)(u, d);
}
static inline CUresult ferry_cuDeviceGetPCIBusId(void *f, char *id, int len, CUdevice d) {
	return ((CUresult (*)(char *, int, CUdevice))f)(id, len, d);
}
static inline CUresult ferry_cuDeviceTotalMem(void *f, size_t *bytes, CUdevice d) {
	return ((CUresult (*)(size_t *, CUdevice))f)(bytes, d);
}
static inline CUresult ferry_cuDeviceGetAttribute(void *f, int *v, int attr, CUdevice d) {
	return ((CUresult (*)(int *, int, CUdevice))f)(v, attr, d);
}
static inline CUresult ferry_cuDevicePrimaryCtxRetain(void *f, CUcontext *c, CUdevice d) {
	return ((CUresult (*)(CUcontext *, CUdevice))f)(c, d);
}
static inline CUresult ferry_cuDevicePrimaryCtxRelease(void *f, CUdevice d) {
	return ((CUresult (*)(CUdevice))f)(d);
}
static inline CUresult ferry_cuCtxSetCurrent(void *f, CUcontext c) {
	return ((CUresult (*)(CUcontext))f)(c);
}
static inline CUresult ferry_cuMemAlloc(void *f, CUdeviceptr *p, size_t n) {
	return ((CUresult (*)(CUdeviceptr *, size_t))f)(p, n);
}
static inline CUresult ferry_cuMemFree(void *f, CUdeviceptr p) {
	return ((CUresult (*)(CUdeviceptr))f)(p);
}
static inline CUresult ferry_cuMemcpyHtoD(void *f, CUdeviceptr dst, const void *src, size_t n) {
	return ((CUresult (*)(CUdeviceptr, const void *, size_t))f)(dst, src, n);
}
static inline CUresult ferry_cuMemcpyDtoH(void *f, void *dst, CUdeviceptr src, size_t n) {
	return ((CUresult (*)(void *, CUdeviceptr, size_t))f)(dst, src, n);
}
// cuPointerSetAttribute takes a pointer to the value: an unsigned int flag.
static inline CUresult ferry_setSyncMemops(void *f, CUdeviceptr p) {
	unsigned int on = 1;
	return ((CUresult (*)(const void *, int, CUdeviceptr))f)(&on, FERRY_POINTER_ATTRIBUTE_SYNC_MEMOPS, p);
}
static inline CUresult ferry_cuIpcGetMemHandle(void *f, ferry_ipc_handle *h, CUdeviceptr p) {
	return ((CUresult (*)(ferry_ipc_handle *, CUdeviceptr))f)(h, p);
}
// cuIpcOpenMemHandle takes the handle by value.
static inline CUresult ferry_cuIpcOpenMemHandle(void *f, CUdeviceptr *p, const ferry_ipc_handle *h) {
	return ((CUresult (*)(CUdeviceptr *, ferry_ipc_handle, unsigned int))f)(p, *h, FERRY_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}
static inline CUresult ferry_cuMemGetAddressRange(void *f, CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	return ((CUresult (*)(CUdeviceptr *, size_t *, CUdeviceptr))f)(base, size, p);
}
static inline CUresult ferry_cuIpcCloseMemHandle(void *f, CUdeviceptr p) {
	return ((CUresult (*)(CUdeviceptr))f)(p);
}
static inline CUresult ferry_cuMemHostAlloc(void *f, void **p, size_t n) {
	return ((CUresult (*)(void **, size_t, unsigned int))f)(p, n, 0);
}
static inline CUresult ferry_cuMemFreeHost(void *f, void *p) {
	return ((CUresult (*)(void *))f)(p);
}
static inline CUresult ferry_dmabufExport(void *f, int *fd, CUdeviceptr p, size_t n) {
	return ((CUresult (*)(void *, CUdeviceptr, size_t, int, unsigned long long))f)(
		fd, p, n, FERRY_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
}

#endif
