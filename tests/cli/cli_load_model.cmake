# The DLRM reference's --load-model and --inference-only: a run saved with --save-model, loaded
# with --inference-only, prints the test AUC and logloss of the run's final evaluation and writes
# nothing to the loaded file; loaded without it, it continues from the saved step (the file still
# untouched, no --save-model given).
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/model.ckpt)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
set(common train --config ${CONFIG} --optimizer adagrad --learning-rate 0.05)
fusekit(trained ${common} --steps 60 --print-every 0 --save-model ${WORK}/model.ckpt)
file(SHA256 ${WORK}/model.ckpt saved)
fusekit(loaded ${common} --steps 60 --print-every 0 --load-model ${WORK}/model.ckpt --inference-only)
set(metrics "test logloss [0-9.]+, AUC [0-9.]+")
string(REGEX MATCH "eval final, step 60: ${metrics}" want "${trained}")
string(REGEX MATCH "eval inference-only, step 60: ${metrics}" got "${loaded}")
string(REPLACE "final," "inference-only," want "${want}")
if(want STREQUAL "" OR NOT want STREQUAL got)
  message(FATAL_ERROR "the loaded model evaluates differently:\n  trained: ${want}\n  loaded:  ${got}")
endif()
if(loaded MATCHES "step [0-9]+/|summary:|checkpoint:")
  message(FATAL_ERROR "--inference-only trained or saved")
endif()
fusekit(continued ${common} --steps 80 --load-model ${WORK}/model.ckpt --print-every 10)
if(NOT continued MATCHES "loaded [^\n]* at step 60\n" OR NOT continued MATCHES "step 70/80.*step 80/80"
   OR continued MATCHES "step 60/80")
  message(FATAL_ERROR "--load-model did not continue from step 60")
endif()
file(SHA256 ${WORK}/model.ckpt after)
if(NOT saved STREQUAL after)
  message(FATAL_ERROR "--load-model wrote the loaded file without --save-model")
endif()
message("load-model: the same test metrics, continued from step 60, the file kept")
