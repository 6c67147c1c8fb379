// Marks a hot CPU function to be compiled twice, for x86-64-v3 (AVX2, FMA, F16C) and
// for the baseline, with the variant picked once at load time. Elsewhere a no-op.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PAGEDATTN_NO_MULTIVERSION)
#define PAGEDATTN_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PAGEDATTN_HOT
#endif
