# run(COMMAND...): runs a command, prints its output, and stops the script when it fails (the
# CLI tests' scripts include this).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

# fusekit(out_var ARGS...): runs ${FUSEKIT} ARGS the same way and keeps its standard output in
# out_var.
function(fusekit out_var)
  execute_process(COMMAND ${FUSEKIT} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${FUSEKIT} ${ARGN}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()
