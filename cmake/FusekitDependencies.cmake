# Finds what fusekit builds against. A missing dependency stops the configuration with one line
# that names the Debian package providing it; scripts/setup.sh installs all of them.
function(fusekit_missing what package)
  message(FATAL_ERROR "fusekit: ${what} not found: install the Debian package ${package} "
                      "(scripts/setup.sh installs every dependency)")
endfunction()

# find_package(NAME [VERSION...]) of a package Debian's DEBIAN_PACKAGE provides; a macro, so
# that what it finds is set where it is called.
macro(fusekit_require NAME DEBIAN_PACKAGE)
  find_package(${NAME} ${ARGN} QUIET)
  if(NOT ${NAME}_FOUND)
    fusekit_missing("${NAME} ${ARGN}" ${DEBIAN_PACKAGE})
  endif()
endmacro()

# find_path(VAR HEADER) of a header Debian's DEBIAN_PACKAGE provides.
macro(fusekit_require_header VAR HEADER DEBIAN_PACKAGE)
  find_path(${VAR} ${HEADER})
  if(NOT ${VAR})
    fusekit_missing("${HEADER}" ${DEBIAN_PACKAGE})
  endif()
endmacro()

fusekit_require(fmt libfmt-dev)
fusekit_require(nlohmann_json nlohmann-json3-dev 3.10)
fusekit_require(ZLIB zlib1g-dev)  # gzip-compressed Criteo TSV input
find_package(Threads REQUIRED)  # the data loader's prefetch threads
fusekit_require_header(DLPACK_INCLUDE_DIR dlpack/dlpack.h libdlpack-dev)
fusekit_require_header(XXHASH_INCLUDE_DIR xxhash.h libxxhash-dev)  # the binary format's XXH3-64 checksums (inlined)
if(FUSEKIT_BUILD_APPS)
  fusekit_require(CLI11 libcli11-dev)
endif()
if(FUSEKIT_BUILD_TESTS)
  fusekit_require(GTest libgtest-dev)
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
