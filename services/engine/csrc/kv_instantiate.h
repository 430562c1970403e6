/* Compiles the C file being built (the one including this) once per K/V pool type: its part
 * after `#else` (under `#ifndef KV_T ... #else`) sees KV_T (float, then bf16_t), KV_NAME(x)
 * (x_f32, x_bf16) and KV_STORE(x) (a float32 value as a KV_T). -DKV_ONLY_F32 or -DKV_ONLY_BF16
 * compiles one type's part only, so a build can compile the two as objects side by side. */
#ifndef KV_ONLY_BF16
#define KV_T float
#define KV_NAME(name) name##_f32
#define KV_STORE(x) (x)
#include __BASE_FILE__
#undef KV_T
#undef KV_NAME
#undef KV_STORE
#endif
#ifndef KV_ONLY_F32
#define KV_T bf16_t
#define KV_NAME(name) name##_bf16
#define KV_STORE(x) to_bf16(x)
#include __BASE_FILE__
#undef KV_T
#undef KV_NAME
#undef KV_STORE
#endif
