# Decides whether the CUDA kernels are built (FUSEKIT_CUDA = AUTO | ON | OFF) and how.
#
# Machine code is generated for each entry of FUSEKIT_CUDA_ARCHS through explicit -gencode flags,
# so that arch-specific targets such as 90a (wgmma, setmaxnreg) work with any CMake >= 3.25.
set(FUSEKIT_WITH_CUDA OFF)
if(NOT FUSEKIT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES OFF)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(FUSEKIT_WITH_CUDA ON)
  elseif(FUSEKIT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FUSEKIT_CUDA=ON but no CUDA compiler was found (set CUDACXX or CMAKE_CUDA_COMPILER)")
  else()
    message(STATUS "fusekit: no CUDA toolkit found; building the CPU-only library")
  endif()
endif()

if(FUSEKIT_WITH_CUDA)
  # CMake 3.25 predates nvcc's C++20 support: teach it the flag, then ask for C++20 as usual.
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(FUSEKIT_CUDA_GENCODE "")
  foreach(arch IN LISTS FUSEKIT_CUDA_ARCHS)
    list(APPEND FUSEKIT_CUDA_GENCODE "-gencode=arch=compute_${arch},code=sm_${arch}")
  endforeach()
  message(STATUS "fusekit: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, targets ${FUSEKIT_CUDA_ARCHS}")
endif()

# Applies fusekit's nvcc flags to the CUDA sources of a target.
function(fusekit_cuda_target target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${FUSEKIT_CUDA_GENCODE} --expt-relaxed-constexpr -lineinfo>)
endfunction()
