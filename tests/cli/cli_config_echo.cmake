# fusekit train --metrics-json: the configuration it echoes, given back as --config, resolves to
# the same configuration (what --dry-run prints after its first line).
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/metrics.json)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
fusekit(trained train --config ${CONFIG} --steps 3 --eval-every 2 --optimizer adagrad --learning-rate 0.05
    --print-every 0 --data-workers 2 --metrics-json ${WORK}/metrics.json)
file(READ ${WORK}/metrics.json metrics)
string(JSON echo GET "${metrics}" config)
file(WRITE ${WORK}/echo.json "${echo}")
fusekit(dry train --config ${WORK}/echo.json --dry-run)
string(FIND "${dry}" "\n" first_line_end)
string(SUBSTRING "${dry}" ${first_line_end} -1 resolved)
string(JSON same EQUAL "${echo}" "${resolved}")
if(NOT same)
  message(FATAL_ERROR "the echo read back differs:\n  echo:     ${echo}\n  resolved: ${resolved}")
endif()
message("echo: the same configuration")
