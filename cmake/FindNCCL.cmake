# FindNCCL: NVIDIA's collective communication library, for fusekit's NCCL communicator.
#
# Looks, in this order, in NCCL_ROOT (a folder holding include/nccl.h and lib/libnccl.so*), the
# nvidia/nccl folder of the configuring Python's site-packages (PyPI's nvidia-nccl-cu13 / -cu12
# wheel, which PyTorch installs), then the system's folders (Debian's libnccl-dev) and the CUDA
# toolkit's. The wheel ships lib/libnccl.so.2 and no libnccl.so, so that name is searched too, in
# each folder before the next (NAMES_PER_DIR: the library comes from the header's folder).
#
# Gives NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION (from nccl.h) and the imported
# target NCCL::NCCL (a shared library: programs need libnccl.so.2 at run time, from the folder it
# was linked from through the build tree's RPATH, or from LD_LIBRARY_PATH).
set(_nccl_hints "")
if(NCCL_ROOT)
  list(APPEND _nccl_hints "${NCCL_ROOT}")
endif()
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import importlib.util as u; s = u.find_spec('nvidia.nccl'); print(list(s.submodule_search_locations)[0])"
      OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _nccl_rc)
    if(_nccl_rc EQUAL 0 AND EXISTS "${_nccl_wheel}/include/nccl.h")
      list(APPEND _nccl_hints "${_nccl_wheel}")
    endif()
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _ "${_nccl_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL SHARED IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    IMPORTED_SONAME "libnccl.so.2"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
