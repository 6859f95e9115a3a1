# fusekit eval --predictions: a checkpoint of 100 steps on tiny evaluated, and its predictions file
# checked by predictions_check against the metrics eval printed (one line per test sample, 0/1
# labels, probabilities in (0, 1), the same logloss and AUC to 1e-4). A path in a missing
# directory is refused before anything is evaluated.
# Run with -DFUSEKIT=<binary> -DCHECK=<predictions_check> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/state.ckpt ${WORK}/predictions.tsv)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
run(${FUSEKIT} train --config ${CONFIG} --steps 100 --print-every 0 --checkpoint ${WORK}/state.ckpt)
execute_process(COMMAND ${FUSEKIT} eval --checkpoint ${WORK}/state.ckpt --predictions ${WORK}/predictions.tsv
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "eval: test logloss ([0-9.]+), AUC ([0-9.]+), accuracy [0-9.]+ \\(([0-9]+) samples")
  message(FATAL_ERROR "fusekit eval --predictions failed or printed no metrics")
endif()
run(${CHECK} ${WORK}/predictions.tsv ${CMAKE_MATCH_3} ${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
execute_process(COMMAND ${FUSEKIT} eval --checkpoint ${WORK}/state.ckpt --predictions ${WORK}/no-such-dir/p.tsv
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "a path in an existing directory" OR out MATCHES "eval: test")
  message(FATAL_ERROR "a predictions path in a missing directory was not refused before the evaluation:\n${out}${err}")
endif()
message("eval: predictions checked")
