# fusekit train stops a diverged run: a run resumed from a good checkpoint with a learning rate
# that blows the model up exits with an error naming the non-finite loss and its step, and the
# checkpoint on disk is still the good one (a diverged state never overwrites it). Before that,
# a resume whose settings differ from the checkpoint's is refused naming the setting (the
# learning rate change needs --resume-override).
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
file(REMOVE ${WORK}/state.ckpt)
set(common train --config ${CONFIG} --print-every 10 --checkpoint ${WORK}/state.ckpt --checkpoint-every 10)
execute_process(COMMAND ${FUSEKIT} ${common} --steps 20 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the good run failed (${rc}):\n${out}${err}")
endif()
file(SHA256 ${WORK}/state.ckpt good)
execute_process(COMMAND ${FUSEKIT} ${common} --steps 60 --resume --data-seed 99
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "data.seed: stored 3, requested 99")
  message(FATAL_ERROR "a resume with another data seed was not refused naming data.seed:\n${out}${err}")
endif()
execute_process(COMMAND ${FUSEKIT} ${common} --steps 60 --resume --resume-override --learning-rate 1e30
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the diverged run exited 0")
endif()
if(NOT "${out}${err}" MATCHES "argument 'loss': expected a finite training loss .*got [-a-z]*nan|argument 'loss': expected a finite training loss .*got [-]?inf")
  message(FATAL_ERROR "no error naming the non-finite loss")
endif()
file(SHA256 ${WORK}/state.ckpt after)
if(NOT good STREQUAL after)
  message(FATAL_ERROR "the checkpoint was overwritten by the diverged run")
endif()
message("diverge: stopped with an error, the good checkpoint kept")
