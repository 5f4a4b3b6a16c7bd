/* The boundary tables of ferry_kernels.h, checked here against the prototypes and exported for
 * load_kernels()'s check of its ctypes table; and the library's one out-of-memory exit. */
#include <stdio.h>
#include <stdlib.h>

#include "ferry_kernels.h"

/* Each row of FERRY_KERNEL_FUNCTIONS is its function's prototype, or this file does not compile. */
#define FERRY_ABI_CHECK(ret, name, params)                                                          \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), ret(*) params),                 \
                   "ferry_kernels.h: the FERRY_KERNEL_FUNCTIONS row of " #name " is not its prototype");
FERRY_KERNEL_FUNCTIONS(FERRY_ABI_CHECK)
#undef FERRY_ABI_CHECK

/* A type's kind letter (ferry_abi_function's signatures); through a pointer to it, so void works. */
#define FERRY_KIND(T) \
    _Generic((T *)0, void *: 'v', int64_t *: 'i', int *: 'I', float *: 'f', double *: 'd', default: 'p')
/* The kind letters of up to 16 parameter types, comma separated. */
#define FERRY_NARG_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define FERRY_NARG(...) FERRY_NARG_(__VA_ARGS__, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
#define FERRY_CAT_(a, b) a##b
#define FERRY_CAT(a, b) FERRY_CAT_(a, b)
#define FERRY_KINDS(...) FERRY_CAT(FERRY_K, FERRY_NARG(__VA_ARGS__))(__VA_ARGS__)
#define FERRY_K1(a) FERRY_KIND(a)
#define FERRY_K2(a, ...) FERRY_KIND(a), FERRY_K1(__VA_ARGS__)
#define FERRY_K3(a, ...) FERRY_KIND(a), FERRY_K2(__VA_ARGS__)
#define FERRY_K4(a, ...) FERRY_KIND(a), FERRY_K3(__VA_ARGS__)
#define FERRY_K5(a, ...) FERRY_KIND(a), FERRY_K4(__VA_ARGS__)
#define FERRY_K6(a, ...) FERRY_KIND(a), FERRY_K5(__VA_ARGS__)
#define FERRY_K7(a, ...) FERRY_KIND(a), FERRY_K6(__VA_ARGS__)
#define FERRY_K8(a, ...) FERRY_KIND(a), FERRY_K7(__VA_ARGS__)
#define FERRY_K9(a, ...) FERRY_KIND(a), FERRY_K8(__VA_ARGS__)
#define FERRY_K10(a, ...) FERRY_KIND(a), FERRY_K9(__VA_ARGS__)
#define FERRY_K11(a, ...) FERRY_KIND(a), FERRY_K10(__VA_ARGS__)
#define FERRY_K12(a, ...) FERRY_KIND(a), FERRY_K11(__VA_ARGS__)
#define FERRY_K13(a, ...) FERRY_KIND(a), FERRY_K12(__VA_ARGS__)
#define FERRY_K14(a, ...) FERRY_KIND(a), FERRY_K13(__VA_ARGS__)
#define FERRY_K15(a, ...) FERRY_KIND(a), FERRY_K14(__VA_ARGS__)
#define FERRY_K16(a, ...) FERRY_KIND(a), FERRY_K15(__VA_ARGS__)

typedef struct {
    const char *name;
    char sig[20]; /* return kind, ':', 16 argument kinds at most, NUL */
} abi_function_t;
#define FERRY_ABI_FUNCTION(ret, name, params) {#name, {FERRY_KIND(ret), ':', FERRY_KINDS params, 0}},
static const abi_function_t FUNCTIONS[] = {FERRY_KERNEL_FUNCTIONS(FERRY_ABI_FUNCTION)};
#undef FERRY_ABI_FUNCTION
#define N_FUNCTIONS (int64_t)(sizeof(FUNCTIONS) / sizeof(FUNCTIONS[0]))

typedef struct {
    const char *name;
    int64_t size;
} abi_struct_t;
#define FERRY_ABI_STRUCT(T) {#T, (int64_t)sizeof(T)},
static const abi_struct_t STRUCTS[] = {FERRY_KERNEL_STRUCTS(FERRY_ABI_STRUCT)};
#undef FERRY_ABI_STRUCT
#define N_STRUCTS (int64_t)(sizeof(STRUCTS) / sizeof(STRUCTS[0]))

int64_t ferry_abi_function(int64_t i, const char **name, const char **sig) {
    if (i >= 0 && i < N_FUNCTIONS) {
        *name = FUNCTIONS[i].name;
        *sig = FUNCTIONS[i].sig;
    }
    return N_FUNCTIONS;
}

int64_t ferry_abi_struct(int64_t i, const char **name, int64_t *size) {
    if (i >= 0 && i < N_STRUCTS) {
        *name = STRUCTS[i].name;
        *size = STRUCTS[i].size;
    }
    return N_STRUCTS;
}

void ferry_oom(const char *what, size_t bytes) {
    fprintf(stderr, "ferry kernels: out of memory allocating %zu bytes for %s\n", bytes, what);
    abort();
}
