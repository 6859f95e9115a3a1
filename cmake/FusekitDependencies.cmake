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

# NCCL (a CUDA build only; FUSEKIT_NCCL = AUTO | ON | OFF): sets FUSEKIT_WITH_NCCL and the target
# NCCL::NCCL. AUTO uses an NCCL that is already there (FindNCCL.cmake: NCCL_ROOT, the configuring
# Python's nvidia-nccl wheel, Debian's libnccl-dev) and never downloads, so that the CPU-only and
# CUDA configurations of CI stay as they were where NCCL is not installed. ON requires it: when
# none is installed, the build downloads PyPI's nvidia-nccl-cu13 wheel (about 200 MB; pip's cache
# serves repeats, PIP_FIND_LINKS a local copy) and unpacks nccl.h and libnccl.so.2 into the build
# folder, as it does the CUTLASS headers; configuration fails when that fails too.
set(FUSEKIT_NCCL_WHEEL_VERSION 2.32.6)
# A shared library linked only into the programs that use one of its symbols: fusekit is a static
# library, and without this every program linking it would need libnccl.so.2 to start.
# fusekitConfig.cmake defines the same feature for the programs that find_package(fusekit).
set(CMAKE_LINK_LIBRARY_USING_fusekit_as_needed "LINKER:--push-state,--as-needed" "<LINK_ITEM>" "LINKER:--pop-state")
set(CMAKE_LINK_LIBRARY_USING_fusekit_as_needed_SUPPORTED TRUE)
macro(fusekit_find_nccl)
  set(FUSEKIT_WITH_NCCL OFF)
  if(NOT FUSEKIT_NCCL STREQUAL "OFF")
    if(NOT FUSEKIT_WITH_CUDA)
      if(FUSEKIT_NCCL STREQUAL "ON")
        message(FATAL_ERROR "FUSEKIT_NCCL=ON needs the CUDA build (FUSEKIT_CUDA and a CUDA toolkit)")
      endif()
    else()
      set(_nccl_dest "${PROJECT_BINARY_DIR}/_deps/nccl")
      if(NOT NCCL_ROOT AND EXISTS "${_nccl_dest}/include/nccl.h")
        set(NCCL_ROOT "${_nccl_dest}")  # unpacked by an earlier configuration
      endif()
      find_package(NCCL QUIET)
      if(NOT NCCL_FOUND AND FUSEKIT_NCCL STREQUAL "ON")
        fusekit_fetch_nccl_wheel("${_nccl_dest}")
        set(NCCL_ROOT "${_nccl_dest}")
        find_package(NCCL QUIET)
      endif()
      if(NCCL_FOUND)
        set(FUSEKIT_WITH_NCCL ON)
        get_filename_component(FUSEKIT_NCCL_ROOT "${NCCL_INCLUDE_DIR}" DIRECTORY)  # for fusekitConfig.cmake
        message(STATUS "fusekit: NCCL ${NCCL_VERSION} found (${NCCL_LIBRARY}): building the NCCL communicator")
      elseif(FUSEKIT_NCCL STREQUAL "ON")
        message(FATAL_ERROR "FUSEKIT_NCCL=ON but no NCCL was found nor unpacked into ${_nccl_dest} "
                            "(pass -DNCCL_ROOT=<folder with include/nccl.h and lib/libnccl.so*>, or install "
                            "Debian's libnccl-dev or PyPI's nvidia-nccl-cu13)")
      else()
        message(STATUS "fusekit: no NCCL found: no NCCL communicator (-DFUSEKIT_NCCL=ON downloads it)")
      endif()
    endif()
  endif()
endmacro()

function(fusekit_fetch_nccl_wheel dest)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(NOT Python3_Interpreter_FOUND)
    message(FATAL_ERROR "fusekit: FUSEKIT_NCCL=ON found no NCCL and no Python with pip to download PyPI's "
                        "nvidia-nccl-cu13==${FUSEKIT_NCCL_WHEEL_VERSION}; pass -DNCCL_ROOT=<its folder>")
  endif()
  message(STATUS "fusekit: downloading NCCL ${FUSEKIT_NCCL_WHEEL_VERSION} (PyPI nvidia-nccl-cu13, about 200 MB)")
  file(REMOVE_RECURSE "${dest}")
  execute_process(COMMAND "${Python3_EXECUTABLE}" -m pip download --quiet --no-deps --disable-pip-version-check
                          --only-binary=:all: --dest "${dest}/wheel" "nvidia-nccl-cu13==${FUSEKIT_NCCL_WHEEL_VERSION}"
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  file(GLOB wheel "${dest}/wheel/nvidia_nccl_cu13-*.whl")
  if(NOT rc EQUAL 0 OR NOT wheel)
    message(FATAL_ERROR "fusekit: could not download nvidia-nccl-cu13==${FUSEKIT_NCCL_WHEEL_VERSION} with "
                        "${Python3_EXECUTABLE} -m pip (${err}); pass -DNCCL_ROOT=<folder with include/nccl.h and "
                        "lib/libnccl.so*>, or -DFUSEKIT_NCCL=AUTO to build without NCCL")
  endif()
  file(ARCHIVE_EXTRACT INPUT "${wheel}" DESTINATION "${dest}/wheel/unpacked"
       PATTERNS "nvidia/nccl/include/nccl.h" "nvidia/nccl/lib/libnccl.so.2")
  file(RENAME "${dest}/wheel/unpacked/nvidia/nccl/include" "${dest}/include")
  file(RENAME "${dest}/wheel/unpacked/nvidia/nccl/lib" "${dest}/lib")
  file(REMOVE_RECURSE "${dest}/wheel")
endfunction()
