# fusekit train --distributed --checkpoint / --resume on NP ranks: a run stopped at step 20 and
# resumed prints the same losses at steps 30 and 40 as a run never stopped, and its checkpoint
# (consolidated by fusekit eval, N -> 1) predicts every test sample with the same float; the
# distributed run's final evaluation equals fusekit eval's of its checkpoint; a shard file missing
# is an error naming the flag.
# Run with -DFUSEKIT=<binary> -DMPIEXEC=<mpirun> -DNP=<ranks> -DCONFIG=<configs/tiny_dcnv2.json>
# -DWORK=<scratch folder>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/straight ${WORK}/resumed)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
set(mpi ${MPIEXEC} -np ${NP} --oversubscribe ${FUSEKIT})
set(common train --config ${CONFIG} --distributed --print-every 10 --optimizer adagrad --learning-rate 0.05
    --rowwise-adagrad --max-shard-rows 700)
function(mpi_run out_var)
  execute_process(COMMAND ${mpi} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${mpi} ${ARGN}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
mpi_run(straight ${common} --steps 40 --checkpoint ${WORK}/straight/state.ckpt)
mpi_run(first ${common} --steps 20 --checkpoint ${WORK}/resumed/state.ckpt --checkpoint-every 10)
mpi_run(resumed ${common} --steps 40 --checkpoint ${WORK}/resumed/state.ckpt --resume)
string(REGEX MATCHALL "step (30|40)/40 [^\n]* loss [0-9.]+" want "${straight}")
string(REGEX MATCHALL "step (30|40)/40 [^\n]* loss [0-9.]+" got "${resumed}")
list(LENGTH want n)
if(NOT n EQUAL 2 OR NOT "${want}" STREQUAL "${got}" OR NOT "${resumed}" MATCHES "resumed from .* at step 20")
  message(FATAL_ERROR "resumed losses differ:\n  straight: ${want}\n  resumed:  ${got}")
endif()
# Only the last checkpoint's shard files remain.
file(GLOB left ${WORK}/resumed/state.ckpt.step*)
list(LENGTH left n)
if(NOT n EQUAL NP)
  message(FATAL_ERROR "expected ${NP} shard files, found: ${left}")
endif()
foreach(run straight resumed)
  fusekit(eval_${run} eval --checkpoint ${WORK}/${run}/state.ckpt --predictions ${WORK}/${run}/predictions.tsv)
endforeach()
file(READ ${WORK}/straight/predictions.tsv a)
file(READ ${WORK}/resumed/predictions.tsv b)
if(NOT a STREQUAL b)
  message(FATAL_ERROR "the resumed run's checkpoint predicts otherwise than the straight run's")
endif()
string(REGEX MATCH "test logloss [0-9.]+, AUC [0-9.]+" final "${straight}")
if(final STREQUAL "" OR NOT "${eval_straight}" MATCHES "${final}")
  message(FATAL_ERROR "fusekit eval of the checkpoint (${eval_straight}) differs from the run's final evaluation (${final})")
endif()
# A missing shard file (another number of ranks: cli_resume_reshard.cmake).
file(REMOVE ${WORK}/resumed/state.ckpt.step40.rank1-of-${NP})
execute_process(COMMAND ${FUSEKIT} eval --checkpoint ${WORK}/resumed/state.ckpt
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${err}" MATCHES "--checkpoint.*shard file of rank 1")
  message(FATAL_ERROR "a missing shard file was not refused naming it: ${out}${err}")
endif()
message("distributed resume: same losses and predictions on ${NP} ranks")
