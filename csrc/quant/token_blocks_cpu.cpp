// CPU kernels of centred blocks along tokens (spec: lazyzero/ops/quant_reference.py, "Blocks along
// tokens"), the form an attention's query and key are stored in (lazyzero/activations/by_channel.py).
//
// A task is one token block of one lead index, for a chunk of channels. It reads those rows of the
// storage where they lie (each row contiguous across the chunk's channels, the last token read again
// for the padding), widens them into a scratch laid out channel by channel that stays in L2, and
// centres and quantizes each channel's block there: no copy of the input, no pass over it but this.
// Restoring runs the same tasks backwards: decode each channel's block into the scratch, then write
// the rows out.
#include <lazyzero/dispatch.h>
#include <lazyzero/parallel.h>
#include <lazyzero/quant_math.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "quant/quant_block_cpu.h"
#include "quant/quant_common.h"
#include "quant/quant_cpu.h"

namespace lazyzero::quant {
namespace {

// Channels per task: 32 channels of 256 fp32 tokens is a 32 KiB scratch.
constexpr int64_t kChannelsPerTask = 32;
constexpr int64_t kElementsPerTask = 1 << 16;

// One task's part of the storage: token block `token_block` of lead index `lead`, channels
// [first_channel, first_channel + width).
struct Tile {
  int64_t lead;
  int64_t token_block;
  int64_t first_channel;
  int64_t width;
};

int64_t channel_chunks(const TokenBlocks& blocks) {
  return (blocks.channels + kChannelsPerTask - 1) / kChannelsPerTask;
}

Tile tile_of(int64_t task, const TokenBlocks& blocks) {
  const int64_t chunks = channel_chunks(blocks);
  const int64_t chunk = task % chunks;
  const int64_t rest = task / chunks;
  const int64_t first = chunk * kChannelsPerTask;
  return {rest / blocks.token_blocks, rest % blocks.token_blocks, first,
          std::min(kChannelsPerTask, blocks.channels - first)};
}

int64_t block_index(const Tile& tile, int64_t channel_in_tile, const TokenBlocks& blocks) {
  return (tile.lead * blocks.channels + tile.first_channel + channel_in_tile) *
             blocks.token_blocks + tile.token_block;
}

// Row `i` of the tile's token block: the storage offset of its first channel (the last token for
// rows past the end).
int64_t row_offset(const Tile& tile, int64_t i, const TokenBlocks& blocks) {
  const int64_t token = std::min(tile.token_block * blocks.block_size + i, blocks.tokens - 1);
  return (tile.lead * blocks.tokens + token) * blocks.channels + tile.first_channel;
}

// What one thread works in: kChannelsPerTask blocks of fp32 (channel after channel), and one block's
// uniforms and unpacked int4 codes.
struct Workspace {
  std::vector<float> blocks;
  std::vector<float> uniforms;
  std::vector<int8_t> unpacked;
};

// Calls run(tile, workspace) for every tile, tiles spread over threads.
template <typename Run>
void for_each_tile(const TokenBlocks& blocks, const Run& run) {
  const int64_t tasks = blocks.lead * blocks.token_blocks * channel_chunks(blocks);
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / (kChannelsPerTask * blocks.block_size));
  parallel_for_tasks(tasks, grain, [&](int64_t begin, int64_t end) {
    Workspace workspace{std::vector<float>(kChannelsPerTask * blocks.block_size),
                        std::vector<float>(blocks.block_size),
                        std::vector<int8_t>(blocks.block_size)};
    for (int64_t task = begin; task < end; ++task) run(tile_of(task, blocks), workspace);
  });
}

// The middle of the block's range in fp32, NaN when the block holds a NaN.
float block_centre(const float* x, int64_t len) {
  float low = x[0];
  float high = x[0];
  bool any_nan = false;
  for (int64_t i = 0; i < len; ++i) {
    low = x[i] < low ? x[i] : low;
    high = x[i] > high ? x[i] : high;
    any_nan |= x[i] != x[i];
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : div_rn(add_rn(low, high), 2.0f);
}

template <typename T, bool kPackInt4>
void quantize_tiles(const at::Tensor& x, const TokenBlocks& blocks, const Rounding& rounding,
                    void* codes, float* scales, T* centres) {
  const T* src = x.const_data_ptr<T>();
  const int64_t block_size = blocks.block_size;
  for_each_tile(blocks, [&](const Tile& tile, Workspace& workspace) {
    float* scratch = workspace.blocks.data();
    for (int64_t i = 0; i < block_size; ++i) {
      const T* row = src + row_offset(tile, i, blocks);
      for (int64_t k = 0; k < tile.width; ++k) scratch[k * block_size + i] = static_cast<float>(row[k]);
    }
    for (int64_t k = 0; k < tile.width; ++k) {
      const int64_t b = block_index(tile, k, blocks);
      float* block = scratch + k * block_size;
      const T centre = static_cast<T>(block_centre(block, block_size));
      const float stored_centre = static_cast<float>(centre);
      for (int64_t i = 0; i < block_size; ++i) block[i] = block[i] - stored_centre;
      int8_t* out = kPackInt4 ? workspace.unpacked.data() : static_cast<int8_t*>(codes) + b * block_size;
      scales[b] = quantize_block(block, block_size, b * block_size, rounding, workspace.uniforms.data(), out);
      if constexpr (kPackInt4) pack_int4(out, block_size, static_cast<uint8_t*>(codes) + b * block_size / 2);
      centres[b] = centre;
    }
  });
}

// code * scale + centre in fp32 for each element of block `b` (block_size is even for int4 codes, so
// the block starts at byte b * block_size / 2).
template <bool kPackInt4>
void decode_block(const void* codes, int64_t b, int64_t block_size, float scale, float centre,
                  float* out) {
  if constexpr (kPackInt4) {
    const uint8_t* packed = static_cast<const uint8_t*>(codes) + b * block_size / 2;
    for (int64_t j = 0; j < block_size / 2; ++j) {
      out[2 * j] = add_rn(dequantize_code(low_nibble_code(packed[j]), scale), centre);
      out[2 * j + 1] = add_rn(dequantize_code(high_nibble_code(packed[j]), scale), centre);
    }
  } else {
    const int8_t* block = static_cast<const int8_t*>(codes) + b * block_size;
    for (int64_t i = 0; i < block_size; ++i) out[i] = add_rn(dequantize_code(block[i], scale), centre);
  }
}

template <typename T, bool kPackInt4>
void restore_tiles(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& centres,
                   const TokenBlocks& blocks, const at::Tensor& out) {
  const float* scale_data = scales.const_data_ptr<float>();
  const T* centre_data = centres.const_data_ptr<T>();
  T* dst = out.mutable_data_ptr<T>();
  const int64_t block_size = blocks.block_size;
  for_each_tile(blocks, [&](const Tile& tile, Workspace& workspace) {
    float* scratch = workspace.blocks.data();
    for (int64_t k = 0; k < tile.width; ++k) {
      const int64_t b = block_index(tile, k, blocks);
      decode_block<kPackInt4>(codes.const_data_ptr(), b, block_size, scale_data[b],
                              static_cast<float>(centre_data[b]), scratch + k * block_size);
    }
    const int64_t rows = std::min(block_size, blocks.tokens - tile.token_block * block_size);
    for (int64_t i = 0; i < rows; ++i) {
      T* row = dst + row_offset(tile, i, blocks);
      for (int64_t k = 0; k < tile.width; ++k) row[k] = static_cast<T>(scratch[k * block_size + i]);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_token_blocks_cpu(
    const at::Tensor& x, int64_t tokens, int64_t channels, int64_t bits, int64_t block_size,
    bool stochastic, int64_t seed) {
  const TokenBlocks blocks = check_quantize_token_blocks_args(x, tokens, channels, bits, block_size);
  const bool packs_int4 = packs_int4_for(bits);
  auto [codes, scales, centres] = allocate_token_block_outputs(x, blocks, packs_int4);
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize_token_blocks", [&] {
    const auto run = packs_int4 ? quantize_tiles<scalar_t, true> : quantize_tiles<scalar_t, false>;
    run(input, blocks, rounding, codes.data_ptr(), scales.mutable_data_ptr<float>(),
        centres.mutable_data_ptr<scalar_t>());
  });
  return {codes, scales, centres};
}

at::Tensor restore_token_blocks_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                    const at::Tensor& centres, int64_t tokens, int64_t channels,
                                    int64_t bits, int64_t block_size) {
  const TokenBlocks blocks =
      check_restore_token_blocks_args(codes, scales, centres, tokens, channels, bits, block_size);
  at::Tensor out = at::empty({blocks.lead * tokens * channels}, centres.options());
  const at::Tensor code_data = codes.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  const at::Tensor centre_data = centres.contiguous();
  LZ_DISPATCH_FLOAT_TYPES(centres.scalar_type(), "lazyzero::restore_token_blocks", [&] {
    const auto run = packs_int4_for(bits) ? restore_tiles<scalar_t, true> : restore_tiles<scalar_t, false>;
    run(code_data, scale_data, centre_data, blocks, out);
  });
  return out;
}

}  // namespace lazyzero::quant
