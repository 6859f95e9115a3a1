# fusekit train --checkpoint / --resume: a run stopped at step 20 and resumed prints the same
# losses at steps 30 and 40 as a run never stopped, and fusekit eval reads the checkpoint.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>, and
# -DEXTRA=<more flags> (a list) for every run.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/state.ckpt)
set(common train --config ${CONFIG} --print-every 10 --optimizer adagrad --learning-rate 0.05 ${EXTRA})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
fusekit(straight ${common} --steps 40)
fusekit(first ${common} --steps 20 --checkpoint ${WORK}/state.ckpt)
fusekit(resumed ${common} --steps 40 --checkpoint ${WORK}/state.ckpt --resume)
string(REGEX MATCHALL "step (30|40)/40 [^\n]* loss [0-9.]+" want "${straight}")
string(REGEX MATCHALL "step (30|40)/40 [^\n]* loss [0-9.]+" got "${resumed}")
list(LENGTH want n)
if(NOT n EQUAL 2 OR NOT "${want}" STREQUAL "${got}")
  message(FATAL_ERROR "resumed losses differ:\n  straight: ${want}\n  resumed:  ${got}")
endif()
# The summary's train loss covers only this run's part of the epoch, and says so.
if(NOT "${resumed}" MATCHES "mean over the last epoch's 20 steps run since the resume")
  message(FATAL_ERROR "the resumed run's summary does not say what its train loss covers")
endif()
fusekit(evaluated eval --checkpoint ${WORK}/state.ckpt)
message("resume: same losses at steps 30 and 40")
