#include "build_info.inc"
#include "fusekit/fusekit.hpp"

namespace fk {

BuildInfo build_info() noexcept {
  return {FUSEKIT_VERSION, FUSEKIT_COMMIT, FUSEKIT_WITH_CUDA != 0, FUSEKIT_CUDA_TARGETS,
          FUSEKIT_CUDA_COMPILER_VERSION, FUSEKIT_BUILD_TYPE};
}

}  // namespace fk
