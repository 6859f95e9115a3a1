# Finds what fusekit builds against. A missing dependency stops the configuration with one line
# that names the Debian package providing it; scripts/setup.sh installs all of them.
function(fusekit_missing what package)
  message(FATAL_ERROR "fusekit: ${what} not found: install the Debian package ${package} "
                      "(scripts/setup.sh installs every dependency)")
endfunction()

find_package(fmt QUIET)
if(NOT fmt_FOUND)
  fusekit_missing("fmt" libfmt-dev)
endif()
find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  fusekit_missing("nlohmann-json >= 3.10" nlohmann-json3-dev)
endif()
find_package(ZLIB QUIET)  # gzip-compressed Criteo TSV input
if(NOT ZLIB_FOUND)
  fusekit_missing("zlib" zlib1g-dev)
endif()
find_package(Threads REQUIRED)  # the data loader's prefetch threads
find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h)
if(NOT DLPACK_INCLUDE_DIR)
  fusekit_missing("dlpack/dlpack.h" libdlpack-dev)
endif()
find_path(XXHASH_INCLUDE_DIR xxhash.h)  # the binary format's XXH3-64 block checksums (inlined)
if(NOT XXHASH_INCLUDE_DIR)
  fusekit_missing("xxhash.h" libxxhash-dev)
endif()
if(FUSEKIT_BUILD_APPS)
  find_package(CLI11 QUIET)
  if(NOT CLI11_FOUND)
    fusekit_missing("CLI11" libcli11-dev)
  endif()
endif()
if(FUSEKIT_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    fusekit_missing("GoogleTest" libgtest-dev)
  endif()
endif()

# The CUTLASS/CuTe headers (a CUDA build only), from PyPI's nvidia-cutlass wheel: its
# cutlass_library/source/include. FUSEKIT_CUTLASS_DIR names a folder that holds cute/ and cutlass/;
# left empty, the build downloads the wheel with the configuring Python's pip (pip's own cache
# serves repeats) and unpacks the headers into the build folder. Either way the kernels include
# them through <build>/_deps/cutlass/include, a path that is the same in every build folder, so
# that ccache shares objects across build folders and checkouts.
set(FUSEKIT_CUTLASS_VERSION 4.2.0.0)
function(fusekit_find_cutlass out)
  set(dest "${PROJECT_BINARY_DIR}/_deps/cutlass")
  if(FUSEKIT_CUTLASS_DIR)
    if(NOT EXISTS "${FUSEKIT_CUTLASS_DIR}/cute/tensor.hpp")
      message(FATAL_ERROR "fusekit: FUSEKIT_CUTLASS_DIR=${FUSEKIT_CUTLASS_DIR} holds no cute/tensor.hpp "
                          "(expected the include folder of CUTLASS ${FUSEKIT_CUTLASS_VERSION})")
    endif()
    file(REMOVE_RECURSE "${dest}")
    file(MAKE_DIRECTORY "${dest}")
    file(CREATE_LINK "${FUSEKIT_CUTLASS_DIR}" "${dest}/include" SYMBOLIC)
  elseif(NOT EXISTS "${dest}/include/cute/tensor.hpp"
         OR NOT EXISTS "${dest}/nvidia-cutlass-${FUSEKIT_CUTLASS_VERSION}")
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(NOT Python3_Interpreter_FOUND)
      message(FATAL_ERROR "fusekit: the CUTLASS headers need a Python with pip to download PyPI's "
                          "nvidia-cutlass==${FUSEKIT_CUTLASS_VERSION}; or pass -DFUSEKIT_CUTLASS_DIR=<its include folder>")
    endif()
    message(STATUS "fusekit: downloading the CUTLASS ${FUSEKIT_CUTLASS_VERSION} headers (PyPI nvidia-cutlass)")
    file(REMOVE_RECURSE "${dest}")
    execute_process(COMMAND "${Python3_EXECUTABLE}" -m pip download --quiet --no-deps --disable-pip-version-check
                            --dest "${dest}/wheel" "nvidia-cutlass==${FUSEKIT_CUTLASS_VERSION}"
                    RESULT_VARIABLE rc ERROR_VARIABLE err)
    file(GLOB wheel "${dest}/wheel/nvidia_cutlass-*.whl")
    if(NOT rc EQUAL 0 OR NOT wheel)
      message(FATAL_ERROR "fusekit: could not download nvidia-cutlass==${FUSEKIT_CUTLASS_VERSION} with "
                          "${Python3_EXECUTABLE} -m pip (${err}); pass -DFUSEKIT_CUTLASS_DIR=<its include folder>")
    endif()
    file(ARCHIVE_EXTRACT INPUT "${wheel}" DESTINATION "${dest}/wheel/unpacked"
         PATTERNS "cutlass_library/source/include/*")
    file(RENAME "${dest}/wheel/unpacked/cutlass_library/source/include" "${dest}/include")
    file(REMOVE_RECURSE "${dest}/wheel")
    file(TOUCH "${dest}/nvidia-cutlass-${FUSEKIT_CUTLASS_VERSION}")
  endif()
  set(${out} "${dest}/include" PARENT_SCOPE)
endfunction()
