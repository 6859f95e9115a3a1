// Uses the installed fusekit: the spec path of the pointwise op, which runs on any machine.
#include <fusekit/fusekit.hpp>

#include <cstdio>

int main() {
  float x[4] = {-1, 2, -3, 4}, b[2] = {0.5f, -0.5f};
  const fk::TensorView xv(x, fk::DType::f32, {2, 2}, fk::Device::cpu());
  const fk::TensorView bv(b, fk::DType::f32, {2}, fk::Device::cpu());
  fk::bias_act_forward({xv, std::nullopt, bv, xv, std::nullopt}, {fk::Activation::relu, 1.0f});
  const bool ok = x[0] == 0.0f && x[1] == 1.5f && x[2] == 0.0f && x[3] == 3.5f;
  std::printf("consumer: fusekit %s, relu(x + b) %s\n", fk::build_info().version, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
