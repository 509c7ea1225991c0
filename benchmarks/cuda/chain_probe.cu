// The action expert's GEMM chain as one persistent CUDA kernel (sm_90a), for benchmarks/cuda_chain_probe.py.
//
// One block per SM runs every phase of a flow step (per layer: QKV, attention, o, norm, gate|up, down, norm;
// the phases without weights only synchronize here). Three roles per block:
//   warp 8 (weights):      streams the block's weight tiles of every phase, in order, into a ring of shared
//                          memory slots with bulk copies signalled by mbarriers. It never waits for another
//                          block: weights do not depend on activations, so it runs ahead through the phase
//                          boundaries as far as the ring allows.
//   warp 9 (activations):  waits until every block has finished the previous phase (a counter per phase in
//                          global memory), then copies the activation k-tiles its block's tiles need into a
//                          second ring; for a phase without weights it only adds its block's arrival.
//   warps 0-7 (math):      multiply each weight tile with its activation tile on the tensor cores (bf16 in,
//                          fp32 accumulate), write one fp32 partial per output chunk they touched (split-K
//                          partials, as the engine's skinny GEMMs defer them), then add the block's arrival
//                          to the phase's counter.
//
// Tiles. A phase computes out[M, N] = x[M, K] @ W[N, K]^T. W is packed (cuda_chain_probe.pack_weight) as 16 KB
// tiles of 64 output columns x 128 k, chunk-major (the k-tiles of output chunk 0, then of chunk 1, ...); x as
// k-tiles of M rows x 128 k (pack_x). Each tile is two atoms of 64 k whose rows are 128 bytes, the 16-byte
// pieces of row r stored at piece ^ (r & 7): the 128-byte swizzle that wgmma descriptors name, which also lets
// ldmatrix read 8 rows without bank conflicts. Block b takes the phase's tiles [b * T / G, (b + 1) * T / G): a
// contiguous run, so it touches at most JMAX output chunks, each ending in a partial of M x 64 fp32
// (partials[part_base + b * JMAX + j], its chunk in tags[...]).
//
// One kernel per math mode (the template argument of `chain`):
//   chain_stream  (0) no products: the math warps take and give back the slots (the bare stream)
//   chain_mma     (1) mma.sync m16n8k16, per warp 16 rows x 32 columns
//   chain_wgmma   (2) wgmma m64n32k16, per warpgroup 64 rows x 32 columns, operands straight from the slots
//   chain_wgmma2  (3) the same with two tiles in flight: even and odd tiles of a run go to two accumulators,
//                     summed before the partial is written; a tile's slots are given back once the next
//                     tile's products are issued
//   chain_mma_gx  (4) mma.sync with the activations loaded straight from global memory into registers (run
//                     with xload = 0: the activation warp only signals that the previous phase is complete)
// xload = 0: the activation slots are signalled without copying (the grid-wide wait still happens).
// sync, bits that take parts of a phase boundary away:
//   1  no __threadfence before the release add (the release alone orders the block's partial writes)
//   2  poll the counter with relaxed loads, then one acquire fence
//   4  no proxy fence before the activation copies (valid only because the probe's activations are never
//      written inside the kernel)
//   8  no wait for the previous phase at all (a diagnostic: the stream and the slot hand-offs alone)
//   16 no partial stores (a diagnostic: what writing them costs)
// trace (nullptr: none): %globaltimer stamps in ns. First TRACE per block and phase: [0] the activation warp
// saw the previous phase complete (or began), [1] the math warps had the first tile's weights and activations,
// [2] they finished the last tile, [3] they added their arrival, [4] the weight warp issued the phase's first
// copy (0 where the block has no tile of the phase). Then, per block, phase and tile of its run (the first
// TILE_STAMPS), three: weights ready, activations ready, products done.
#include <cstdint>

namespace {

constexpr int TILE_BYTES = 16384;      // 64 output columns x 128 k, bf16
constexpr int ROW_BYTES = 128;         // 64 bf16 of k: one row of an atom
constexpr int ATOM_BYTES = 64 * ROW_BYTES;  // 64 rows (a weight atom; an activation atom, rows >= M zero)
constexpr int X_SLOT_BYTES = 2 * ATOM_BYTES;
constexpr int MATH_WARPS = 8;
constexpr int MATH_THREADS = MATH_WARPS * 32;
constexpr int JMAX = 3;
constexpr int FIELDS = 6;              // per phase: w_offset, tiles, ktiles, x_offset, part_base, reserved
constexpr int TRACE = 5;               // stamps per block and phase (see the header)
constexpr int TILE_STAMPS = 16;        // tiles per block and phase with stamps of their own

__device__ __forceinline__ long long now_ns() {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte piece `piece` (0-15: k 8 piece .. +7) of row `row` in a packed tile (see the header).
__device__ __forceinline__ uint32_t swizzled(int row, int piece) {
  return (piece >> 3) * ATOM_BYTES + row * ROW_BYTES + (((piece & 7) ^ (row & 7)) << 4);
}

// A wgmma shared-memory descriptor of a K-major operand with the 128-byte swizzle: 8-row groups 1024 bytes
// apart (atoms are 1024-byte aligned, so the base offset is 0).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
  return (static_cast<uint64_t>((addr >> 4) & 0x3FFF)) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_m64n32k16(float (&c)[4][4], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;"
      : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]),
        "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]),
        "+f"(c[3][2]), "+f"(c[3][3])
      : "l"(a), "l"(b));
}

// The warpgroup's share of one tile with wgmma: warpgroup g (warps 4g .. 4g + 3) computes all 64 rows and
// output columns 32 g .. +31 over the tile's 128 k (8 steps of 16, 32 bytes along an atom's swizzled rows).
// Its accumulator layout is the mma.sync one of `tile_mma` (warp w: rows 16 (w & 3) .., columns 32 (w >> 2) ..).
__device__ __forceinline__ void tile_wgmma_issue(uint32_t wtile, uint32_t xtile, int warp, float (&acc)[4][4]) {
  const uint32_t wcols = wtile + (warp >> 2) * 32 * ROW_BYTES;  // row 32 g of each atom (a multiple of 8 rows)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint32_t atom = (ks >> 2) * ATOM_BYTES, step = (ks & 3) * 32;
    wgmma_m64n32k16(acc, wgmma_desc(xtile + atom + step), wgmma_desc(wcols + atom + step));
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void tile_wgmma(uint32_t wtile, uint32_t xtile, int warp, float (&acc)[4][4]) {
  tile_wgmma_issue(wtile, xtile, warp, acc);
  wgmma_wait<0>();
}

// acc += other; other = 0 (the odd tiles' accumulator folded into the even ones').
__device__ __forceinline__ void fold(float (&acc)[4][4], float (&other)[4][4]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[nt][i] += other[nt][i];
      other[nt][i] = 0.f;
    }
}

// One block's run of a phase's tiles.
__device__ __forceinline__ void tile_range(long long tiles, int block, int blocks, int& t0, int& t1) {
  t0 = static_cast<int>(tiles * block / blocks);
  t1 = static_cast<int>(tiles * (block + 1) / blocks);
}

struct Ring {
  uint32_t slot = 0, parity = 0;
  __device__ __forceinline__ void next(int slots) {
    if (++slot == static_cast<uint32_t>(slots)) {
      slot = 0;
      parity ^= 1;
    }
  }
};

// tile_mma with the activations read straight from global memory (L2; ld.global.cg, as data another block
// wrote in this kernel must be read) into the A fragments, all 32 loads issued before the first product: no
// activation copy and no activation slot. xk: the packed k-tile (two atoms of `rows` rows x 128 bytes).
__device__ __forceinline__ void tile_mma_global(uint32_t wtile, const uint8_t* xk, int rows, int warp, int lane,
                                                float (&acc)[4][4]) {
  uint32_t a[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = (warp & 3) * 16 + (lane >> 2) + (i & 1) * 8;
      const int k = ks * 16 + (lane & 3) * 2 + (i >> 1) * 8;
      const int piece = (k & 63) >> 3;
      const uint8_t* at = xk + (k >> 6) * rows * ROW_BYTES + row * ROW_BYTES + ((piece ^ (row & 7)) << 4) + (k & 7) * 2;
      a[ks][i] = row < rows ? __ldcg(reinterpret_cast<const unsigned int*>(at)) : 0u;
    }
  const int b_row = (warp >> 2) * 32 + (lane & 7) + (lane >> 4) * 8;
  const int b_hi = (lane >> 3) & 1;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t b[4];
      ldsm_x4(wtile + swizzled(b_row + 16 * q, 2 * ks + b_hi), b);
      mma_bf16(acc[2 * q], a[ks], b[0], b[1]);
      mma_bf16(acc[2 * q + 1], a[ks], b[2], b[3]);
    }
}

// The math warps' share of one 16 KB tile: warp w computes rows 16 (w & 3) .. +15 and output columns
// 32 (w >> 2) .. +31 of the tile's 64, over its 128 k.
__device__ __forceinline__ void tile_mma(uint32_t wtile, uint32_t xtile, int warp, int lane, float (&acc)[4][4]) {
  const int a_row = (warp & 3) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_hi = lane >> 4;
  const int b_row = (warp >> 2) * 32 + (lane & 7) + (lane >> 4) * 8;
  const int b_hi = (lane >> 3) & 1;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    uint32_t a[4];
    ldsm_x4(xtile + swizzled(a_row, 2 * ks + a_hi), a);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t b[4];
      ldsm_x4(wtile + swizzled(b_row + 16 * q, 2 * ks + b_hi), b);
      mma_bf16(acc[2 * q], a, b[0], b[1]);
      mma_bf16(acc[2 * q + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ void flush(float (&acc)[4][4], float* part, int rows, int warp, int lane, bool store) {
  const int row = store ? (warp & 3) * 16 + (lane >> 2) : rows;  // rows: nothing stored
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = (warp >> 2) * 32 + nt * 8 + 2 * (lane & 3);
    if (row < rows) *reinterpret_cast<float2*>(part + row * 64 + col) = make_float2(acc[nt][0], acc[nt][1]);
    if (row + 8 < rows) *reinterpret_cast<float2*>(part + (row + 8) * 64 + col) = make_float2(acc[nt][2], acc[nt][3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
  }
}

}  // namespace

// The kernel body; MATH is a template argument because a wgmma behind a runtime branch makes ptxas serialize
// every wgmma (C7518). One extern "C" kernel per mode follows.
template <int math>
__device__ __forceinline__ void chain(const uint8_t* __restrict__ w, const long long* __restrict__ phases,
                                      int n_phases, const uint8_t* __restrict__ x, float* __restrict__ partials,
                                      int* __restrict__ tags, uint32_t* __restrict__ arrivals, int rows,
                                      int w_slots, int x_slots, int xload, int sync, long long* __restrict__ trace) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t w_ring = smem_addr(smem);
  const uint32_t x_ring = w_ring + w_slots * TILE_BYTES;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + w_slots * TILE_BYTES + x_slots * X_SLOT_BYTES);
  const uint32_t w_full = smem_addr(bars), w_empty = w_full + 8 * w_slots;
  const uint32_t x_full = w_empty + 8 * w_slots, x_empty = x_full + 8 * x_slots;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int block = blockIdx.x, blocks = gridDim.x;
  long long* stamps = trace ? trace + static_cast<long long>(block) * n_phases * TRACE : nullptr;
  long long* tile_stamps =
      trace ? trace + static_cast<long long>(blocks) * n_phases * TRACE +
                  static_cast<long long>(block) * n_phases * TILE_STAMPS * 3
            : nullptr;

  // Activation rows past `rows` stay zero in every atom of every slot (the copies write rows < rows only).
  const int per_atom = (64 - rows) * ROW_BYTES / 16;
  for (int i = threadIdx.x; i < 2 * x_slots * per_atom; i += blockDim.x) {
    uint8_t* atom = smem + w_slots * TILE_BYTES + (i / per_atom) * ATOM_BYTES;
    reinterpret_cast<uint4*>(atom + rows * ROW_BYTES)[i % per_atom] = make_uint4(0, 0, 0, 0);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // those zeros, then wgmma's reads
  if (threadIdx.x == 0) {
    for (int s = 0; s < w_slots; ++s) {
      mbar_init(w_full + 8 * s, 1);
      mbar_init(w_empty + 8 * s, MATH_WARPS);
    }
    for (int s = 0; s < x_slots; ++s) {
      mbar_init(x_full + 8 * s, 1);
      mbar_init(x_empty + 8 * s, MATH_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == MATH_WARPS) {  // the weight stream
    if (lane == 0) {
      Ring ring;
      for (int p = 0; p < n_phases; ++p) {
        const long long* ph = phases + FIELDS * p;
        int t0, t1;
        tile_range(ph[1], block, blocks, t0, t1);
        for (int t = t0; t < t1; ++t) {
          mbar_wait(w_empty + 8 * ring.slot, ring.parity ^ 1);
          if (stamps && t == t0) stamps[p * TRACE + 4] = now_ns();
          mbar_expect_tx(w_full + 8 * ring.slot, TILE_BYTES);
          bulk_copy(w_ring + ring.slot * TILE_BYTES, w + ph[0] + static_cast<long long>(t) * TILE_BYTES, TILE_BYTES,
                    w_full + 8 * ring.slot);
          ring.next(w_slots);
        }
      }
    }
    return;
  }
  if (warp == MATH_WARPS + 1) {  // the activations, after each phase's barrier
    if (lane == 0) {
      Ring ring;
      const uint32_t x_bytes = rows * ROW_BYTES;
      for (int p = 0; p < n_phases; ++p) {
        const long long* ph = phases + FIELDS * p;
        if (p > 0 && !(sync & 8)) {
          if (sync & 2) {
            while (load_relaxed(arrivals + p - 1) < static_cast<uint32_t>(blocks)) {
            }
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
          } else {
            while (load_acquire(arrivals + p - 1) < static_cast<uint32_t>(blocks)) {
            }
          }
          if (!(sync & 4)) asm volatile("fence.proxy.async.global;" ::: "memory");  // generic writes, then bulk reads
        }
        if (stamps) stamps[p * TRACE] = now_ns();
        const int ktiles = static_cast<int>(ph[2]);
        int t0, t1;
        tile_range(ph[1], block, blocks, t0, t1);
        if (t0 == t1) {  // nothing of this phase here (or a phase without weights): arrive now
          add_release(arrivals + p, 1);
          continue;
        }
        for (int t = t0; t < t1; ++t) {
          mbar_wait(x_empty + 8 * ring.slot, ring.parity ^ 1);
          if (xload) {  // the k-tile's two atoms of `rows` rows each
            mbar_expect_tx(x_full + 8 * ring.slot, 2 * x_bytes);
            const uint8_t* src = x + ph[3] + static_cast<long long>(t % ktiles) * 2 * x_bytes;
            bulk_copy(x_ring + ring.slot * X_SLOT_BYTES, src, x_bytes, x_full + 8 * ring.slot);
            bulk_copy(x_ring + ring.slot * X_SLOT_BYTES + ATOM_BYTES, src + x_bytes, x_bytes, x_full + 8 * ring.slot);
          } else {
            mbar_arrive(x_full + 8 * ring.slot);
          }
          ring.next(x_slots);
        }
      }
    }
    return;
  }

  // The math warps.
  Ring wr, xr;
  float acc[4][4], odd[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = odd[nt][i] = 0.f;
  bool pending = false;  // math 3: the previous tile's products may still be running (its slots held)
  uint32_t pending_w = 0, pending_x = 0;
  auto give_back = [&](uint32_t ws, uint32_t xs, bool really) {
    __syncwarp();
    if (really && lane == 0) {
      mbar_arrive(w_empty + 8 * ws);
      mbar_arrive(x_empty + 8 * xs);
    }
  };
  auto drain = [&]() {  // math 3: every product done, its slots given back, the odd tiles folded in
    wgmma_wait<0>();  // (no branch around wgmma waits: ptxas would serialize every wgmma)
    give_back(pending_w, pending_x, pending);
    pending = false;
    fold(acc, odd);
  };
  for (int p = 0; p < n_phases; ++p) {
    const long long* ph = phases + FIELDS * p;
    const int ktiles = static_cast<int>(ph[2]);
    int t0, t1;
    tile_range(ph[1], block, blocks, t0, t1);
    if (t0 == t1) continue;  // warp 9 arrives for this block
    int chunk = t0 / ktiles, j = 0;
    const long long base = ph[4] + static_cast<long long>(block) * JMAX;
    for (int t = t0; t < t1; ++t) {
      if (t / ktiles != chunk) {
        if (math == 3) drain();
        if (threadIdx.x == 0 && !(sync & 16)) tags[base + j] = chunk;
        flush(acc, partials + (base + j) * 64 * rows, rows, warp, lane, !(sync & 16));
        ++j;
        chunk = t / ktiles;
      }
      mbar_wait(w_full + 8 * wr.slot, wr.parity);
      long long* ts = tile_stamps && threadIdx.x == 0 && t - t0 < TILE_STAMPS
                          ? tile_stamps + (static_cast<long long>(p) * TILE_STAMPS + (t - t0)) * 3
                          : nullptr;
      if (ts) ts[0] = now_ns();
      mbar_wait(x_full + 8 * xr.slot, xr.parity);
      if (ts) ts[1] = now_ns();
      if (stamps && t == t0 && threadIdx.x == 0) stamps[p * TRACE + 1] = now_ns();
      if (math == 1) tile_mma(w_ring + wr.slot * TILE_BYTES, x_ring + xr.slot * X_SLOT_BYTES, warp, lane, acc);
      if (math == 4) {
        const uint8_t* xk = x + ph[3] + static_cast<long long>(t % ktiles) * 2 * rows * ROW_BYTES;
        tile_mma_global(w_ring + wr.slot * TILE_BYTES, xk, rows, warp, lane, acc);
      }
      if (math == 2) tile_wgmma(w_ring + wr.slot * TILE_BYTES, x_ring + xr.slot * X_SLOT_BYTES, warp, acc);
      if (math == 3) {
        if ((t - t0) & 1) {
          tile_wgmma_issue(w_ring + wr.slot * TILE_BYTES, x_ring + xr.slot * X_SLOT_BYTES, warp, odd);
        } else {
          tile_wgmma_issue(w_ring + wr.slot * TILE_BYTES, x_ring + xr.slot * X_SLOT_BYTES, warp, acc);
        }
        wgmma_wait<1>();  // the previous tile's group (if any) is done
        give_back(pending_w, pending_x, pending);
        pending = true;
        pending_w = wr.slot;
        pending_x = xr.slot;
      } else {
        give_back(wr.slot, xr.slot, true);
      }
      if (ts) ts[2] = now_ns();
      wr.next(w_slots);
      xr.next(x_slots);
    }
    if (math == 3) drain();
    if (stamps && threadIdx.x == 0) stamps[p * TRACE + 2] = now_ns();
    if (threadIdx.x == 0 && !(sync & 16)) tags[base + j] = chunk;
    flush(acc, partials + (base + j) * 64 * rows, rows, warp, lane, !(sync & 16));
    asm volatile("bar.sync 1, %0;" ::"n"(MATH_THREADS) : "memory");
    if (threadIdx.x == 0) {
      if (!(sync & 1)) __threadfence();
      add_release(arrivals + p, 1);
      if (stamps) stamps[p * TRACE + 3] = now_ns();
    }
  }
}

#define CHAIN_KERNEL(NAME, MATH)                                                                                  \
  extern "C" __global__ void __launch_bounds__((MATH_WARPS + 2) * 32, 1)                                         \
      NAME(const uint8_t* __restrict__ w, const long long* __restrict__ phases, int n_phases,                   \
           const uint8_t* __restrict__ x, float* __restrict__ partials, int* __restrict__ tags,                 \
           uint32_t* __restrict__ arrivals, int rows, int w_slots, int x_slots, int xload, int sync,            \
           long long* __restrict__ trace) {                                                                      \
    chain<MATH>(w, phases, n_phases, x, partials, tags, arrivals, rows, w_slots, x_slots, xload, sync, trace);    \
  }

CHAIN_KERNEL(chain_stream, 0)
CHAIN_KERNEL(chain_mma, 1)
CHAIN_KERNEL(chain_wgmma, 2)
CHAIN_KERNEL(chain_wgmma2, 3)
CHAIN_KERNEL(chain_mma_gx, 4)
