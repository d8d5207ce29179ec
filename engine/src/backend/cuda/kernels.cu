// Sluice's cuda backend kernels, compiled at run time with NVRTC.
//
// bf16 values travel as raw `unsigned short` (no cuda_bf16.h: nothing to
// include, the same source compiles wherever NVRTC does). Activations that
// feed a GEMM are bf16; the residual stream, GEMM outputs, norm weights,
// biases and RoPE tables are f32. The KV cache is bf16, one slab per layer
// and kind, `[num_blocks, block_size, num_kv_heads, head_dim]`, the CPU
// backend's layout.
//
// The attention kernel is specialised per model: the host defines
// SLUICE_HEAD_DIM and SLUICE_GROUP (query heads per kv head) when compiling.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#ifndef SLUICE_HEAD_DIM
#define SLUICE_HEAD_DIM 128
#endif
#ifndef SLUICE_GROUP
#define SLUICE_GROUP 1
#endif

// Threads of one attention block: also the positions scored per tile.
#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / 32)

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16_to_f32(bf16_t v) {
    return __uint_as_float(((u32)v) << 16);
}

// Round to nearest even, NaN kept quiet: what `half::bf16::from_f32` does.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((bits >> 16) | 0x40u);
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the total. Once per kernel: it owns its shared scratch.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) {
        total += partial[w];
    }
    return total;
}

// x[t, :] = embed[tokens[t], :] (bf16 rows to the f32 residual stream).
// Grid: one block per token.
extern "C" __global__ void embed_gather(
    float* __restrict__ x,
    const bf16_t* __restrict__ embed,
    const u32* __restrict__ tokens,
    int hidden)
{
    const size_t t = blockIdx.x;
    const bf16_t* row = embed + (size_t)tokens[t] * hidden;
    float* out = x + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[i] = bf16_to_f32(row[i]);
    }
}

// out[r, :] = bf16(w * x[src, :] / rms(x[src, :])), src = rows ? rows[r] : r.
// Grid: one block per output row.
extern "C" __global__ void rms_norm(
    bf16_t* __restrict__ out,
    const float* __restrict__ x,
    const float* __restrict__ weight,
    const u32* __restrict__ rows,
    int hidden,
    float eps)
{
    const size_t r = blockIdx.x;
    const size_t src = rows ? (size_t)rows[r] : r;
    const float* xr = x + src * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    bf16_t* o = out + r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        o[i] = f32_to_bf16(weight[i] * (xr[i] * inv));
    }
}

// One token's fused q/k/v row (f32, `[q | k | v]`): adds the bias (when
// given), rotates q and k (HF rotate-half: dimension i pairs with
// i + head_dim/2) with its cos/sin row, leaves q in place and stores k and
// v as bf16 in the token's KV slot. The tables' row is rope_rows[t] when
// given (the token's position in a per-position table), else t (a table
// built for this step). Grid: one block per token.
extern "C" __global__ void qkv_rope_store(
    float* __restrict__ qkv,
    const float* __restrict__ bias,
    const float* __restrict__ cos_table,
    const float* __restrict__ sin_table,
    const u32* __restrict__ rope_rows,
    const u32* __restrict__ slots,
    bf16_t* __restrict__ k_cache,
    bf16_t* __restrict__ v_cache,
    int num_heads,
    int num_kv_heads,
    int head_dim)
{
    const size_t t = blockIdx.x;
    const int half = head_dim / 2;
    const int q_dim = num_heads * head_dim;
    const int kv_dim = num_kv_heads * head_dim;
    float* row = qkv + t * (size_t)(q_dim + 2 * kv_dim);
    const size_t rope_row = rope_rows ? (size_t)rope_rows[t] : t;
    const float* c = cos_table + rope_row * half;
    const float* s = sin_table + rope_row * half;
    const size_t slot = (size_t)slots[t] * kv_dim;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int head = p / half;
        const int i = p - head * half;
        const int a = head * head_dim + i;
        const int b = a + half;
        float u = row[a];
        float v = row[b];
        if (bias) {
            u += bias[a];
            v += bias[b];
        }
        const float cs = c[i];
        const float sn = s[i];
        const float x1 = u * cs - v * sn;
        const float x2 = v * cs + u * sn;
        if (head < num_heads) {
            row[a] = x1;
            row[b] = x2;
        } else {
            const size_t k = slot + (size_t)(a - q_dim);
            k_cache[k] = f32_to_bf16(x1);
            k_cache[k + half] = f32_to_bf16(x2);
        }
    }
    for (int e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        float v = row[q_dim + kv_dim + e];
        if (bias) {
            v += bias[q_dim + kv_dim + e];
        }
        v_cache[slot + e] = f32_to_bf16(v);
    }
}

#define HD SLUICE_HEAD_DIM
#define GROUP SLUICE_GROUP
// V rows are read 8 bf16 (16 bytes) per thread: TPR threads cover a row,
// ROWS rows are in flight per block at once.
#define VEC 8
#define TPR (HD / VEC)
#define ROWS (ATTN_THREADS / TPR)
// Two V rows per thread in flight where registers allow (ptxas spills the
// smallest geometry when unrolled).
#define V_UNROLL ((HD >= 64) ? 2 : 1)
static_assert(HD % VEC == 0 && TPR <= 32 && 32 % TPR == 0,
              "head_dim must be 8, 16, 32, 64, 128 or 256");
// Shared floats: the group's queries and one tile of weights per head while
// scoring; the per-warp partial outputs once the tiles are done.
#define ATTN_SCORE_FLOATS (GROUP * HD + GROUP * ATTN_THREADS)
#define ATTN_REDUCE_FLOATS (ATTN_WARPS * GROUP * HD)
#define ATTN_SHARED_FLOATS \
    (ATTN_SCORE_FLOATS > ATTN_REDUCE_FLOATS ? ATTN_SCORE_FLOATS : ATTN_REDUCE_FLOATS)

__device__ __forceinline__ void unpack8(const uint4 w, float* f) {
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xffff0000u);
    f[4] = __uint_as_float(w.z << 16);
    f[5] = __uint_as_float(w.z & 0xffff0000u);
    f[6] = __uint_as_float(w.w << 16);
    f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// Paged causal attention, GQA. Block (t, kvh) computes the GROUP query heads
// of token t that share kv head kvh over positions 0..=pos[t] of t's
// sequence, read through its block table, ATTN_THREADS positions per tile:
// one thread scores one position against every head of the group (K rows
// in 16-byte loads), an online softmax per head rescales the running
// outputs, then ROWS V rows at a time are read in 16-byte pieces, each
// thread accumulating its 8 dimensions of every head over its rows. The
// partial sums of the threads sharing dimensions are added at the end
// (shuffles within a warp, shared memory across warps). Writes bf16
// outputs `[tokens, num_heads * HD]` (heads of a group side by side).
// (Minimum one block per SM in the launch bounds: without it ptxas may cap
// registers at 128 and spill the accumulators of a group of 8.)
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) paged_attention(
    bf16_t* __restrict__ out,
    const float* __restrict__ qkv,
    const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache,
    const u32* __restrict__ block_tables,
    const u32* __restrict__ token_seq,
    const u32* __restrict__ token_pos,
    int max_blocks,
    int qkv_dim,
    int num_kv_heads,
    int block_size,
    float scale,
    int part_len,
    float* __restrict__ part_acc,
    float* __restrict__ part_ml)
{
    __shared__ float shared[ATTN_SHARED_FLOATS];
    __shared__ u32 slot_s[ATTN_THREADS];
    __shared__ float m_s[GROUP];
    __shared__ float l_s[GROUP];
    __shared__ float corr_s[GROUP];
    float* q_s = shared;                   // [GROUP][HD]
    float* p_s = shared + GROUP * HD;      // [GROUP][ATTN_THREADS]

    const size_t t = blockIdx.x;
    const int kvh = blockIdx.y;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int chunk = tid % TPR;           // this thread's 8 V dimensions
    const int row_lane = tid / TPR;        // which of the ROWS rows in flight

    const float* q = qkv + t * qkv_dim + (size_t)kvh * GROUP * HD;
    for (int i = tid; i < GROUP * HD; i += ATTN_THREADS) {
        q_s[i] = q[i] * scale;
    }
    for (int g = tid; g < GROUP; g += ATTN_THREADS) {
        m_s[g] = NEG_INF;
        l_s[g] = 0.0f;
    }
    const u32* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const int context = (int)token_pos[t] + 1;
    // This block's share of the context: split blockIdx.z of gridDim.z.
    const int split = blockIdx.z;
    const int begin = split * part_len;
    const int end = min(context, begin + part_len);
    const size_t row_stride = (size_t)num_kv_heads * HD;
    const size_t head_offset = (size_t)kvh * HD;
    const bf16_t* v_base = v_cache + head_offset + chunk * VEC;

    float acc[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            acc[g][e] = 0.0f;
        }
    }
    __syncthreads();

    for (int tile = begin; tile < end; tile += ATTN_THREADS) {
        // Scores: this thread's position against every head of the group.
        const int p = tile + tid;
        float s[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            s[g] = NEG_INF;
        }
        if (p < end) {
            const u32 slot = table[p / block_size] * (u32)block_size + (u32)(p % block_size);
            slot_s[tid] = slot;
            const uint4* k = (const uint4*)(k_cache + slot * row_stride + head_offset);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                s[g] = 0.0f;
            }
#pragma unroll
            for (int c = 0; c < TPR; ++c) {
                float kf[VEC];
                unpack8(k[c], kf);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        s[g] += q_s[g * HD + c * VEC + e] * kf[e];
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            p_s[g * ATTN_THREADS + tid] = s[g];
        }
        __syncthreads();

        // Online softmax, one warp per head: new max, weights, running sum.
        for (int g = warp; g < GROUP; g += ATTN_WARPS) {
            float* pg = p_s + g * ATTN_THREADS;
            float mx = NEG_INF;
            for (int j = lane; j < ATTN_THREADS; j += 32) {
                mx = fmaxf(mx, pg[j]);
            }
            mx = warp_max(mx);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int j = lane; j < ATTN_THREADS; j += 32) {
                const float e = expf(pg[j] - m_new);
                pg[j] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                const float corr = expf(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();

        // Weighted V rows into this thread's partial outputs.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float corr = corr_s[g];
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                acc[g][e] *= corr;
            }
        }
        const int valid = min(ATTN_THREADS, end - tile);
        if (row_lane < ROWS) {
#pragma unroll V_UNROLL
            for (int j = row_lane; j < valid; j += ROWS) {
                float vf[VEC];
                unpack8(*(const uint4*)(v_base + (size_t)slot_s[j] * row_stride), vf);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float w = p_s[g * ATTN_THREADS + j];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        acc[g][e] += w * vf[e];
                    }
                }
            }
        }
        __syncthreads();
    }

    // Add up the partial outputs of the threads sharing dimensions: the
    // rows of a warp by shuffles, then the warps through shared memory
    // (the score buffers are free now).
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float v = acc[g][e];
            for (int off = TPR; off < 32; off <<= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, off);
            }
            acc[g][e] = v;
        }
    }
    float* red = shared;                   // [ATTN_WARPS][GROUP][HD]
    if (lane < TPR) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                red[(warp * GROUP + g) * HD + chunk * VEC + e] = acc[g][e];
            }
        }
    }
    __syncthreads();
    const size_t head_base = t * (size_t)num_kv_heads + kvh;
    if (gridDim.z > 1) {
        // One split of several: unnormalised sums and the softmax state,
        // combined by attention_combine. An empty split (past this token's
        // context) leaves m = -inf and l = 0, which weigh nothing there.
        const size_t part = head_base * gridDim.z + split;
        float* pa = part_acc + part * GROUP * HD;
        for (int i = tid; i < GROUP * HD; i += ATTN_THREADS) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) {
                sum += red[w * GROUP * HD + i];
            }
            pa[i] = sum;
        }
        for (int g = tid; g < GROUP; g += ATTN_THREADS) {
            part_ml[(part * GROUP + g) * 2] = m_s[g];
            part_ml[(part * GROUP + g) * 2 + 1] = l_s[g];
        }
        return;
    }
    bf16_t* o = out + head_base * GROUP * HD;
    for (int i = tid; i < GROUP * HD; i += ATTN_THREADS) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            sum += red[w * GROUP * HD + i];
        }
        o[i] = f32_to_bf16(sum / l_s[i / HD]);
    }
}

// The splits of a split attention (paged_attention with gridDim.z > 1)
// into the bf16 outputs: per head, each split's sums rescaled to the
// largest max, divided by the rescaled total weight. Grid: (tokens, kv heads).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attention_combine(
    bf16_t* __restrict__ out,
    const float* __restrict__ part_acc,
    const float* __restrict__ part_ml,
    int num_kv_heads,
    int splits)
{
    const size_t head_base = (size_t)blockIdx.x * num_kv_heads + blockIdx.y;
    const size_t first = head_base * splits;
    bf16_t* o = out + head_base * GROUP * HD;
    for (int i = threadIdx.x; i < GROUP * HD; i += ATTN_THREADS) {
        const int g = i / HD;
        float m = NEG_INF;
        for (int s = 0; s < splits; ++s) {
            m = fmaxf(m, part_ml[((first + s) * GROUP + g) * 2]);
        }
        float sum = 0.0f;
        float weight = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const size_t part = first + s;
            const float scale = expf(part_ml[(part * GROUP + g) * 2] - m);
            weight += part_ml[(part * GROUP + g) * 2 + 1] * scale;
            sum += part_acc[part * GROUP * HD + i] * scale;
        }
        o[i] = f32_to_bf16(sum / weight);
    }
}

// out[t, j] = bf16(silu(gate) * up), gate_up rows `[gate | up]` (f32), each
// plus its bias when given. Grid-stride over tokens * inter.
extern "C" __global__ void swiglu(
    bf16_t* __restrict__ out,
    const float* __restrict__ gate_up,
    const float* __restrict__ bias,
    int inter,
    int tokens)
{
    const size_t total = (size_t)tokens * inter;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / inter;
        const int j = (int)(i - t * inter);
        const float* row = gate_up + t * 2 * (size_t)inter;
        float g = row[j];
        float u = row[inter + j];
        if (bias) {
            g += bias[j];
            u += bias[inter + j];
        }
        out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// x[i] += bias[i % width] over `total` elements (the residual after a
// projection with a bias). Grid-stride.
extern "C" __global__ void add_bias(
    float* __restrict__ x,
    const float* __restrict__ bias,
    int width,
    unsigned long long total)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] += bias[i % width];
    }
}

// A block's serialised form (f32, its `num_slabs` chunks in slab order, the
// KV transfer layout) from the bf16 cache. Grid-stride.
extern "C" __global__ void kv_pack(
    float* __restrict__ dst,
    const bf16_t* __restrict__ cache,
    u32 block,
    u32 num_blocks,
    int num_slabs,
    int chunk)
{
    const size_t total = (size_t)num_slabs * chunk;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t slab = i / chunk;
        const size_t e = i - slab * chunk;
        dst[i] = bf16_to_f32(cache[(slab * num_blocks + block) * chunk + e]);
    }
}

// The inverse of kv_pack: a serialised f32 block into the bf16 cache.
extern "C" __global__ void kv_unpack(
    bf16_t* __restrict__ cache,
    const float* __restrict__ src,
    u32 block,
    u32 num_blocks,
    int num_slabs,
    int chunk)
{
    const size_t total = (size_t)num_slabs * chunk;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t slab = i / chunk;
        const size_t e = i - slab * chunk;
        cache[(slab * num_blocks + block) * chunk + e] = f32_to_bf16(src[i]);
    }
}
