// `fusekit check`'s families (apps/check.cpp runs them): for each, the CPU's hand-worked case and
// the CUDA kernels against the CPU spec on random inputs.
#pragma once

#include <vector>

#include "apps/check_compare.hpp"

namespace fk::app::check {

std::vector<Measure> primitives_by_hand();
std::vector<Measure> primitives_against_spec(Device gpu);
std::vector<Measure> quant_by_hand();
std::vector<Measure> quant_against_spec(Device gpu);
std::vector<Measure> gemm_by_hand();
std::vector<Measure> gemm_against_spec(Device gpu);
std::vector<Measure> glu_by_hand();
std::vector<Measure> glu_against_spec(Device gpu);
std::vector<Measure> qgemm_by_hand();
std::vector<Measure> qgemm_against_spec(Device gpu);
std::vector<Measure> mlp_by_hand();
std::vector<Measure> mlp_against_spec(Device gpu);
std::vector<Measure> lora_by_hand();
std::vector<Measure> lora_against_spec(Device gpu);
std::vector<Measure> recsys_by_hand();
std::vector<Measure> recsys_against_spec(Device gpu);
std::vector<Measure> norm_by_hand();
std::vector<Measure> norm_against_spec(Device gpu);

}  // namespace fk::app::check
