# scripts/plot_metrics.py: two runs' metrics drawn into one PNG; a file that is not a fusekit
# metrics JSON (a config, a PNG) is refused with a message naming it, not a traceback. Skipped
# (SKIP_REGULAR_EXPRESSION) without a Python that has matplotlib.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DPYTHON=<python or empty>
# -DSCRIPT=<scripts/plot_metrics.py> -DWORK=<scratch folder>.
if(NOT PYTHON)
  message("plot_metrics: skipped (no Python 3 interpreter found; set Python3_EXECUTABLE)")
  return()
endif()
execute_process(COMMAND ${PYTHON} -c "import matplotlib" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message("plot_metrics: skipped (${PYTHON} has no matplotlib; set Python3_EXECUTABLE to one that has)")
  return()
endif()
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/runs.png ${WORK}/refused.png)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
run(${FUSEKIT} train --config ${CONFIG} --steps 200 --print-every 40 --eval-every 100 --metrics-json ${WORK}/lr0.2.json)
run(${FUSEKIT} train --config ${CONFIG} --steps 200 --print-every 40 --eval-every 100 --learning-rate 0.05
    --metrics-json ${WORK}/lr0.05.json)
run(${PYTHON} ${SCRIPT} ${WORK}/lr0.2.json ${WORK}/lr0.05.json --out ${WORK}/runs.png)
file(READ ${WORK}/runs.png signature LIMIT 8 HEX)
if(NOT signature STREQUAL "89504e470d0a1a0a")
  message(FATAL_ERROR "${WORK}/runs.png is not a PNG (starts ${signature})")
endif()
foreach(bad ${CONFIG} ${WORK}/runs.png ${WORK}/no-such-file.json)
  execute_process(COMMAND ${PYTHON} ${SCRIPT} ${WORK}/lr0.2.json ${bad} --out ${WORK}/refused.png
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "^plot_metrics: [^\n]*: " OR err MATCHES "Traceback" OR EXISTS ${WORK}/refused.png)
    message(FATAL_ERROR "${bad} was not refused with a message (exit ${rc}):\n${out}${err}")
  endif()
  message("refused: ${err}")
endforeach()
message("plot_metrics: drew two runs, refused what is not a metrics JSON")
