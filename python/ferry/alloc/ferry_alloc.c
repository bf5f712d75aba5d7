/*
 * libferry_alloc.so: tensors born in memory ferryd can reach.
 *
 * Loaded with LD_PRELOAD (ferry-run, or python -m ferry.run), it takes
 * over malloc and its family. An allocation of FERRY_ALLOC_MIN bytes or
 * more (default 64 KiB: tensors, numpy arrays) comes from one memfd of
 * this process, mapped MAP_SHARED over a window of address space reserved
 * once; smaller ones go to glibc. Aligned allocations (posix_memalign and
 * its kin: torch's CPU tensors) come from the window at any size
 * (FERRY_ALLOC_ALIGNED_MIN and up, default 0), so that a framework's
 * small tensors (sglang's per-request metadata buffers, a few KiB) can be
 * registered as its KV can: those under 2 KiB from slabs, window pages cut
 * into blocks of one power-of-two size, kept for reuse once freed. ferry.mooncake lends that memfd to
 * ferryd, which maps the pages an engine registers and lands peers' writes
 * in them: the caller's own pages, at the caller's own addresses, never
 * moved (docs/python.md, "Where registered host memory lives").
 *
 * The window: offset in the memfd = address - base, so free() of a
 * pointer is one range compare. Blocks are whole pages, first fit with
 * coalescing under one mutex. A freed block of FERRY_ALLOC_PUNCH bytes or
 * more (default 2 MiB) has its pages punched out of the memfd
 * (FALLOC_FL_PUNCH_HOLE), so memory returns to the system; smaller ones
 * keep theirs for the next allocation, as glibc's heap does, so that
 * temporaries do not fault their pages in again each time. calloc zeroes
 * a large block by punching it (no page touched), a small one by memset.
 *
 * Fork: the child maps the used part of the window MAP_PRIVATE over the
 * same memfd (the parent's data kept, its own writes private) and then
 * allocates from glibc only, and never frees into the window: the file
 * is the parent's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

#define PAGE 4096UL
#define DEFAULT_MIN (64UL << 10)
#define DEFAULT_WINDOW (256UL << 30)
#define DEFAULT_PUNCH (2UL << 20)
#define SLAB_MIN 64UL
#define SLAB_MAX 2048UL
#define SLAB_CLASSES 6 /* 64 B to 2 KiB */

struct extent {
	uintptr_t start, len;
};

/* A sorted array of extents, its storage from glibc. */
struct list {
	struct extent *v;
	size_t n, cap;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int win_fd = -1;
static uintptr_t win_base, win_len, win_used; /* win_used: the highest block end ever given */
static size_t threshold = DEFAULT_MIN;
static size_t aligned_min; /* FERRY_ALLOC_ALIGNED_MIN */
static size_t punch_min = DEFAULT_PUNCH;
static int in_child; /* a fork child: the window is private, glibc only */
static struct list free_list, used_list;
/* Slab pages: start is the page, len the size of its blocks. A freed
 * block goes on its size's list, linked through its first word. */
static struct list slabs;
static void *slab_free[SLAB_CLASSES];
static size_t (*libc_usable)(void *);

static uintptr_t round_up(uintptr_t n, uintptr_t a) { return (n + a - 1) & ~(a - 1); }

static size_t env_size(const char *name, size_t def)
{
	const char *s = getenv(name);
	if (!s || !*s)
		return def;
	char *end;
	unsigned long long v = strtoull(s, &end, 0);
	switch (*end) {
	case 'k': case 'K': v <<= 10; break;
	case 'm': case 'M': v <<= 20; break;
	case 'g': case 'G': v <<= 30; break;
	}
	return v ? (size_t)v : def;
}

/* The index of the first extent starting at or after addr. */
static size_t lower_bound(struct list *l, uintptr_t addr)
{
	size_t lo = 0, hi = l->n;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (l->v[mid].start < addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int insert_at(struct list *l, size_t i, struct extent e)
{
	if (l->n == l->cap) {
		size_t cap = l->cap ? 2 * l->cap : 256;
		struct extent *v = __libc_realloc(l->v, cap * sizeof *v);
		if (!v)
			return -1;
		l->v = v, l->cap = cap;
	}
	memmove(&l->v[i + 1], &l->v[i], (l->n - i) * sizeof *l->v);
	l->v[i] = e;
	l->n++;
	return 0;
}

static void remove_at(struct list *l, size_t i)
{
	memmove(&l->v[i], &l->v[i + 1], (l->n - i - 1) * sizeof *l->v);
	l->n--;
}

/* Gives [start, start+len) back to the free list, joined with its
 * neighbours; -1 only when the list could not grow (the range is lost). */
static int give_back(uintptr_t start, uintptr_t len)
{
	size_t i = lower_bound(&free_list, start);
	struct extent *prev = i > 0 ? &free_list.v[i - 1] : NULL;
	struct extent *next = i < free_list.n ? &free_list.v[i] : NULL;
	if (prev && prev->start + prev->len == start) {
		prev->len += len;
		if (next && start + len == next->start) {
			prev->len += next->len;
			remove_at(&free_list, i);
		}
		return 0;
	}
	if (next && start + len == next->start) {
		next->start = start;
		next->len += len;
		return 0;
	}
	return insert_at(&free_list, i, (struct extent){start, len});
}

static void init(void)
{
	threshold = env_size("FERRY_ALLOC_MIN", DEFAULT_MIN);
	aligned_min = env_size("FERRY_ALLOC_ALIGNED_MIN", 0);
	punch_min = env_size("FERRY_ALLOC_PUNCH", DEFAULT_PUNCH);
	size_t want = round_up(env_size("FERRY_ALLOC_WINDOW", DEFAULT_WINDOW), PAGE);
	libc_usable = (size_t (*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
	int fd = memfd_create("ferry-alloc", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		goto fail;
	/* ferryd maps this file: sealed against shrinking, so nobody can cut
	 * it short under that mapping (SIGBUS). Holes punched are no shrink. */
	if (ftruncate(fd, (off_t)want) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
		goto fail_fd;
	void *base = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
	if (base == MAP_FAILED)
		goto fail_fd;
	win_fd = fd, win_base = (uintptr_t)base, win_len = want;
	if (give_back(win_base, win_len) != 0)
		win_len = 0;
	return;
fail_fd:
	close(fd);
fail:
	if (getenv("FERRY_ALLOC_DEBUG"))
		fprintf(stderr, "libferry_alloc: no window (%s): every allocation goes to glibc\n", strerror(errno));
	win_len = 0;
}

static int in_window(const void *p)
{
	return win_len && (uintptr_t)p - win_base < win_len;
}

/* A block of at least n bytes aligned to align (a power of two >= PAGE),
 * or NULL when the window has no room (the caller falls back to glibc). */
static void *take(size_t n, size_t align)
{
	pthread_once(&once, init);
	if (!win_len || in_child || n > win_len)
		return NULL;
	uintptr_t len = round_up(n, PAGE);
	void *out = NULL;
	pthread_mutex_lock(&mu);
	for (size_t i = 0; i < free_list.n; i++) {
		struct extent e = free_list.v[i];
		uintptr_t at = round_up(e.start, align);
		if (at < e.start || at - e.start > e.len || e.len - (at - e.start) < len)
			continue;
		size_t used = lower_bound(&used_list, at);
		if (insert_at(&used_list, used, (struct extent){at, len}) != 0)
			break;
		remove_at(&free_list, i);
		if (at > e.start)
			give_back(e.start, at - e.start);
		if (e.start + e.len > at + len)
			give_back(at + len, e.start + e.len - (at + len));
		if (at + len - win_base > win_used)
			win_used = at + len - win_base;
		out = (void *)at;
		break;
	}
	pthread_mutex_unlock(&mu);
	return out;
}

/* The block starting at p, its index in used_list; callers hold mu. */
static ssize_t block_of(const void *p)
{
	size_t i = lower_bound(&used_list, (uintptr_t)p);
	if (i < used_list.n && used_list.v[i].start == (uintptr_t)p)
		return (ssize_t)i;
	return -1;
}

/* The size of the slab blocks on p's page, or 0 when it is no slab
 * page; callers hold mu. */
static size_t slab_size(const void *p)
{
	uintptr_t page = (uintptr_t)p & ~(PAGE - 1);
	size_t i = lower_bound(&slabs, page);
	return i < slabs.n && slabs.v[i].start == page ? slabs.v[i].len : 0;
}

/* A block of size (a power of two from SLAB_MIN to SLAB_MAX, so aligned
 * to it) from a slab, or NULL when the window has no page to cut. */
static void *slab_take(size_t size)
{
	int c = __builtin_ctzl(size) - __builtin_ctzl(SLAB_MIN);
	pthread_once(&once, init);
	if (!win_len || in_child)
		return NULL;
	pthread_mutex_lock(&mu);
	void *p = slab_free[c];
	if (p)
		slab_free[c] = *(void **)p;
	pthread_mutex_unlock(&mu);
	if (p)
		return p;
	uintptr_t page = (uintptr_t)take(PAGE, PAGE);
	if (!page)
		return NULL;
	pthread_mutex_lock(&mu);
	if (insert_at(&slabs, lower_bound(&slabs, page), (struct extent){page, size}) != 0) {
		pthread_mutex_unlock(&mu);
		return NULL; /* the page stays a used block: lost, as glibc's would be */
	}
	for (uintptr_t b = page + size; b < page + PAGE; b += size) {
		*(void **)b = slab_free[c];
		slab_free[c] = (void *)b;
	}
	pthread_mutex_unlock(&mu);
	return (void *)page;
}

static size_t block_size(const void *p)
{
	pthread_mutex_lock(&mu);
	size_t n = slab_size(p);
	if (!n) {
		ssize_t i = block_of(p);
		n = i < 0 ? 0 : used_list.v[i].len;
	}
	pthread_mutex_unlock(&mu);
	return n;
}

static void punch(uintptr_t start, uintptr_t len)
{
	fallocate(win_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(start - win_base), (off_t)len);
}

static void release(void *p)
{
	if (in_child)
		return; /* the parent's file: never punched from here */
	pthread_mutex_lock(&mu);
	size_t size = slab_size(p);
	if (size) {
		int c = __builtin_ctzl(size) - __builtin_ctzl(SLAB_MIN);
		*(void **)p = slab_free[c];
		slab_free[c] = p;
		pthread_mutex_unlock(&mu);
		return;
	}
	ssize_t i = block_of(p);
	if (i < 0) {
		pthread_mutex_unlock(&mu);
		fprintf(stderr, "libferry_alloc: free(%p): no block starts there (a double free, or a pointer into a block)\n", p);
		abort();
	}
	struct extent e = used_list.v[i];
	remove_at(&used_list, (size_t)i);
	/* A large block's pages go back to the system. */
	if (e.len >= punch_min)
		punch(e.start, e.len);
	give_back(e.start, e.len);
	pthread_mutex_unlock(&mu);
}

void *malloc(size_t n)
{
	if (n >= threshold) {
		void *p = take(n, PAGE);
		if (p)
			return p;
	}
	return __libc_malloc(n);
}

void *calloc(size_t k, size_t n)
{
	size_t total;
	if (__builtin_mul_overflow(k, n, &total)) {
		errno = ENOMEM;
		return NULL;
	}
	if (total >= threshold) {
		void *p = take(total, PAGE);
		if (p) {
			/* A freed small block keeps its bytes: zero it. A large one
			 * becomes a hole, zeros with no page touched. */
			if (round_up(total, PAGE) >= punch_min)
				punch((uintptr_t)p, round_up(total, PAGE));
			else
				memset(p, 0, total);
			return p;
		}
	}
	return __libc_calloc(k, n);
}

void free(void *p)
{
	if (in_window(p))
		release(p);
	else
		__libc_free(p);
}

size_t malloc_usable_size(void *p)
{
	if (!p)
		return 0;
	if (in_window(p))
		return block_size(p);
	pthread_once(&once, init);
	return libc_usable ? libc_usable(p) : 0;
}

void *realloc(void *p, size_t n)
{
	if (!p)
		return malloc(n);
	if (n == 0) {
		free(p);
		return NULL;
	}
	size_t old = malloc_usable_size(p);
	if (in_window(p) && n <= old && n >= threshold)
		return p;
	if (!in_window(p) && n < threshold)
		return __libc_realloc(p, n);
	void *q = malloc(n);
	if (!q)
		return NULL;
	memcpy(q, p, old < n ? old : n);
	free(p);
	return q;
}

void *reallocarray(void *p, size_t k, size_t n)
{
	size_t total;
	if (__builtin_mul_overflow(k, n, &total)) {
		errno = ENOMEM;
		return NULL;
	}
	return realloc(p, total);
}

static void *aligned(size_t align, size_t n)
{
	if (n >= threshold || n >= aligned_min) {
		size_t size = SLAB_MIN;
		while ((size < n || size < align) && size <= SLAB_MAX)
			size <<= 1;
		void *p = size <= SLAB_MAX ? slab_take(size) : take(n, align > PAGE ? align : PAGE);
		if (p)
			return p;
	}
	return __libc_memalign(align, n);
}

int posix_memalign(void **out, size_t align, size_t n)
{
	if (align < sizeof(void *) || (align & (align - 1)))
		return EINVAL;
	void *p = aligned(align, n);
	if (!p)
		return ENOMEM;
	*out = p;
	return 0;
}

void *aligned_alloc(size_t align, size_t n)
{
	if (align == 0 || (align & (align - 1))) {
		errno = EINVAL;
		return NULL;
	}
	return aligned(align, n);
}

void *memalign(size_t align, size_t n) { return aligned_alloc(align, n); }
void *valloc(size_t n) { return aligned(PAGE, n); }
void *pvalloc(size_t n) { return aligned(PAGE, round_up(n ? n : 1, PAGE)); }

/* ferry_alloc_window gives the memfd, the window's base and length: 0,
 * or -1 when this process has no window to lend (the preload made none,
 * or this is a fork child, whose window is private). */
int ferry_alloc_window(int *fd, uint64_t *base, uint64_t *len)
{
	pthread_once(&once, init);
	if (!win_len || in_child)
		return -1;
	*fd = win_fd, *base = win_base, *len = win_len;
	return 0;
}

/* ferry_alloc_buffer: n bytes from the window whatever their size (a
 * Mooncake managed buffer), freed with free(); NULL without a window. */
void *ferry_alloc_buffer(size_t n)
{
	return n ? take(n, PAGE) : NULL;
}

/* ferry_alloc_stats: the bytes and blocks the window holds now, and the
 * smallest allocation it takes (FERRY_ALLOC_MIN). */
void ferry_alloc_stats(uint64_t *bytes, uint64_t *blocks, uint64_t *min)
{
	pthread_mutex_lock(&mu);
	uint64_t b = 0;
	for (size_t i = 0; i < used_list.n; i++)
		b += used_list.v[i].len;
	*bytes = b, *blocks = used_list.n, *min = threshold;
	pthread_mutex_unlock(&mu);
}

static void before_fork(void) { pthread_mutex_lock(&mu); }
static void after_fork_parent(void) { pthread_mutex_unlock(&mu); }

static void after_fork_child(void)
{
	pthread_mutex_unlock(&mu);
	if (in_child || !win_len)
		return;
	in_child = 1;
	/* The used part private over the same file (contents as the parent
	 * left them, this child's writes its own); the rest no memory at all.
	 * Failing that, the child would write into its parent's pages: stop. */
	void *p = win_used ? mmap((void *)win_base, win_used, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, win_fd, 0) : (void *)win_base;
	void *q = win_used < win_len ? mmap((void *)(win_base + win_used), win_len - win_used, PROT_NONE,
					    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) : NULL;
	if (p == MAP_FAILED || q == MAP_FAILED) {
		static const char msg[] = "libferry_alloc: a fork child could not make its window private: it stops\n";
		if (write(2, msg, sizeof msg - 1) < 0) {
		}
		_exit(127);
	}
	close(win_fd);
}

__attribute__((constructor)) static void setup(void)
{
	pthread_once(&once, init);
	pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
