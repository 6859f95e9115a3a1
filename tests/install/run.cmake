# Installs the build into WORK/prefix, then configures, builds and runs the consumer against it.
file(REMOVE_RECURSE "${WORK}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed: ${ARGN}\n${err}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD}" --prefix "${WORK}/prefix" --component Unspecified)
run(${CMAKE_COMMAND} -S "${SRC}" -B "${WORK}/build" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK}/prefix"
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build "${WORK}/build")
run("${WORK}/build/consumer")
