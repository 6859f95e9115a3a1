# Installs the build into WORK/prefix, then configures, builds and runs a consumer project against
# it. The consumer is the README's example of calling an op: its main.cpp and CMakeLists.txt are
# the first ```cpp and ```cmake blocks after the README's install_and_consume marker, so that the
# example cannot drift from what builds and runs.
file(REMOVE_RECURSE "${WORK}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed: ${ARGN}\n${err}")
  endif()
endfunction()

# The text of the first ```<lang> block after the marker.
file(READ "${README}" readme)
string(FIND "${readme}" "<!-- install_and_consume " marker)
if(marker EQUAL -1)
  message(FATAL_ERROR "${README}: no <!-- install_and_consume ... --> marker before the example")
endif()
string(SUBSTRING "${readme}" ${marker} -1 readme)
function(readme_block lang out)
  set(fence "```${lang}\n")
  string(FIND "${readme}" "${fence}" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "${README}: no ${fence} block after the install_and_consume marker")
  endif()
  string(LENGTH "${fence}" skip)
  math(EXPR begin "${begin} + ${skip}")
  string(SUBSTRING "${readme}" ${begin} -1 rest)
  string(FIND "${rest}" "\n```" end)
  string(SUBSTRING "${rest}" 0 ${end} block)
  set(${out} "${block}\n" PARENT_SCOPE)
endfunction()
readme_block(cpp main_cpp)
readme_block(cmake lists)
string(REGEX MATCH "add_executable\\(([A-Za-z0-9_]+)" found "${lists}")
if(NOT found)
  message(FATAL_ERROR "${README}: the example's CMakeLists.txt has no add_executable")
endif()
set(program ${CMAKE_MATCH_1})
file(WRITE "${WORK}/src/main.cpp" "${main_cpp}")
file(WRITE "${WORK}/src/CMakeLists.txt" "${lists}")

run(${CMAKE_COMMAND} --install "${BUILD}" --prefix "${WORK}/prefix" --component Unspecified)
# The exported package names its dependencies as targets and its headers relative to the prefix: an
# absolute path from the building machine would break the package anywhere else.
file(GLOB_RECURSE exported "${WORK}/prefix/*/fusekitTargets*.cmake")
if(NOT exported)
  message(FATAL_ERROR "the install tree holds no fusekitTargets*.cmake")
endif()
foreach(file IN LISTS exported)
  file(STRINGS "${file}" properties REGEX "^  INTERFACE_[A-Z_]+ ")
  foreach(line IN LISTS properties)
    if(line MATCHES "(^|[\" ])/")  # the list splits at ";": a path after one starts its item
      message(FATAL_ERROR "${file}: the exported package carries an absolute path: ${line}")
    endif()
  endforeach()
endforeach()
# The build's own compiler: a sanitizer build's library needs that compiler's runtimes.
run(${CMAKE_COMMAND} -S "${WORK}/src" -B "${WORK}/build" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK}/prefix"
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=${CXX}")
run(${CMAKE_COMMAND} --build "${WORK}/build")
run("${WORK}/build/${program}")
