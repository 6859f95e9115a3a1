# fusekit_warnings(target): the warnings fusekit's own code is held to, on every target of the
# project (library, programs, tests, benchmarks, the Python extension); with FUSEKIT_WERROR, as
# errors. Third-party headers are included as system headers, so their warnings never show.
# Argument and record structs are filled by position, their optional trailing members left at
# their defaults: -Wextra's missing-field-initializers would flag every such call.
# GCC 12's -Wrestrict reports overlapping memcpy inside libstdc++'s std::string concatenation, a
# false positive (GCC bug 105329).
function(fusekit_warnings target)
  set(cxx -Wall -Wextra -Wno-missing-field-initializers $<$<CXX_COMPILER_ID:GNU>:-Wno-restrict>)
  set(cuda -Xcompiler=-Wall)
  if(FUSEKIT_WERROR)
    list(APPEND cxx -Werror)
    list(APPEND cuda --Werror=all-warnings -Xcompiler=-Werror)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${cxx}> $<$<COMPILE_LANGUAGE:CUDA>:${cuda}>)
endfunction()
