// The state part of a DLRM checkpoint (dlrm_state_io.hpp).
#include "models/dlrm_state_io.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "fusekit/core/error.hpp"

namespace fk::models::detail {

namespace {

constexpr char kStateMagic[8] = {'F', 'K', 'D', 'L', 'R', 'M', 'S', '1'};
constexpr std::int64_t kCopyChunk = std::int64_t{1} << 24;  // floats per host bounce (64 MB)

// A rank-1 or rank-2 view as rows [rows, cols] (rank 1: [n, 1]).
TensorView as_rows(const TensorView& v) {
  if (v.rank() == 2) return v;
  return TensorView(v.data(), v.dtype(), {v.numel(), 1}, {1, 1}, v.device());
}

// Rows [first, first + n) of a rows view.
TensorView row_range(const TensorView& v, std::int64_t first, std::int64_t n) {
  const auto bytes = static_cast<std::int64_t>(dtype_size(v.dtype()));
  return TensorView(static_cast<char*>(v.data()) + first * v.strides()[0] * bytes, v.dtype(), {n, v.size(1)},
                    v.strides(), v.device());
}

// Between a host tensor of the array's dtype (f32, bf16, f16) and the stream's f32 values: 16-bit
// values widen exactly; f32 values narrow to nearest (exact for values a 16-bit array saved).
void widen(const Tensor& from, float* to) {
  const std::int64_t n = from.numel();
  if (from.dtype() == DType::bf16)
    for (std::int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from.data_as<const bf16>()[i]);
  else
    for (std::int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from.data_as<const f16>()[i]);
}

}  // namespace

void narrow(const float* from, const Tensor& to) {
  const std::int64_t n = to.numel();
  if (to.dtype() == DType::bf16)
    for (std::int64_t i = 0; i < n; ++i) to.data_as<bf16>()[i] = bf16(from[i]);
  else
    for (std::int64_t i = 0; i < n; ++i) to.data_as<f16>()[i] = f16(from[i]);
}

void step_to_floats(std::uint64_t step, float* two) {
  two[0] = static_cast<float>(step & 0xffffffu);
  two[1] = static_cast<float>(step >> 24);
}

std::uint64_t step_from_floats(const float* two, const char* op) {
  for (int i = 0; i < 2; ++i)
    FK_CHECK_ARG(two[i] >= 0 && two[i] < 16777216.0f && two[i] == std::floor(two[i]), op, "in",
                 "rounding steps as whole numbers in [0, 2^24)", fmt::format("{}", two[i]));
  return static_cast<std::uint64_t>(two[0]) | (static_cast<std::uint64_t>(two[1]) << 24);
}

void write_state(std::ostream& out, bool adagrad, const std::vector<TensorView>& arrays) {
  const std::uint8_t flag = adagrad ? 1 : 0;
  const std::uint64_t count = arrays.size();
  out.write(kStateMagic, 8);
  out.write(reinterpret_cast<const char*>(&flag), 1);
  out.write(reinterpret_cast<const char*>(&count), 8);
  for (const TensorView& a : arrays) {
    const std::uint64_t len = static_cast<std::uint64_t>(a.numel());
    out.write(reinterpret_cast<const char*>(&len), 8);
    const TensorView rows = as_rows(a);
    const std::int64_t per = std::max<std::int64_t>(1, kCopyChunk / std::max<std::int64_t>(rows.size(1), 1));
    for (std::int64_t at = 0; at < rows.size(0); at += per) {
      const TensorView part = row_range(rows, at, std::min(per, rows.size(0) - at));
      Tensor host = Tensor::empty(part.shape(), part.dtype(), Device::cpu());
      copy(host, part);
      if (part.dtype() != DType::f32) {
        Tensor wide = Tensor::empty(part.shape(), DType::f32, Device::cpu());
        widen(host, wide.data_as<float>());
        host = std::move(wide);
      }
      out.write(static_cast<const char*>(host.data()), static_cast<std::streamsize>(host.nbytes()));
    }
  }
  if (!out) throw Error("models::Dlrm::save_state", "out", "a writable stream", "a failed write");
}

bool read_state_header(std::istream& in, std::uint64_t& count) {
  char magic[8] = {};
  std::uint8_t adagrad = 0;
  in.read(magic, 8);
  in.read(reinterpret_cast<char*>(&adagrad), 1);
  in.read(reinterpret_cast<char*>(&count), 8);
  FK_CHECK_ARG(in && std::equal(magic, magic + 8, kStateMagic), "models::Dlrm::load_state", "in",
               "a DLRM state (FKDLRMS1)", "something else");
  return adagrad != 0;
}

void read_state_arrays(std::istream& in, std::uint64_t count, const std::vector<TensorView>& arrays) {
  const char* op = "models::Dlrm::load_state";
  FK_CHECK_ARG(count == arrays.size(), op, "in", fmt::format("{} arrays (this configuration)", arrays.size()),
               fmt::format("{}", count));
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    std::uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    FK_CHECK_ARG(in && len == static_cast<std::uint64_t>(arrays[i].numel()), op, "in",
                 fmt::format("array {} of {} floats (this configuration)", i, arrays[i].numel()), fmt::format("{}", len));
    const TensorView rows = as_rows(arrays[i]);
    const std::int64_t per = std::max<std::int64_t>(1, kCopyChunk / std::max<std::int64_t>(rows.size(1), 1));
    for (std::int64_t at = 0; at < rows.size(0); at += per) {
      const TensorView part = row_range(rows, at, std::min(per, rows.size(0) - at));
      Tensor host = Tensor::empty(part.shape(), DType::f32, Device::cpu());
      in.read(static_cast<char*>(host.data()), static_cast<std::streamsize>(host.nbytes()));
      FK_CHECK_ARG(static_cast<bool>(in), op, "in", "a complete state", "a truncated stream");
      if (part.dtype() != DType::f32) {
        Tensor narrowed = Tensor::empty(part.shape(), part.dtype(), Device::cpu());
        narrow(host.data_as<float>(), narrowed);
        host = std::move(narrowed);
      }
      copy(part, host);
    }
  }
}

std::vector<float> read_state_array(std::istream& in, std::uint64_t max_floats, const char* op, const char* arg) {
  std::uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  FK_CHECK_ARG(in && len <= max_floats, op, arg, fmt::format("an array of at most {} floats", max_floats),
               in ? fmt::format("{}", len) : std::string("a truncated stream"));
  std::vector<float> v(static_cast<std::size_t>(len));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(len * sizeof(float)));
  FK_CHECK_ARG(static_cast<bool>(in), op, arg, "a complete state", "a truncated stream");
  return v;
}

}  // namespace fk::models::detail
