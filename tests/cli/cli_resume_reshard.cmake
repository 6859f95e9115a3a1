# fusekit train --distributed resumed on another number of ranks (N -> M): a checkpoint saved at
# step 20 and continued to step 40 on M ranks (and with another --max-shard-rows, or in the
# one-process fusekit train) gives the training state of the run continued on the N ranks that
# saved it, every parameter and accumulator within the distributed tests' tolerance
# (checkpoint_compare): 2 -> 4, 2 -> 1, 2 -> 2 re-split, 2 -> one process, 4 -> 2, 4 -> 3, and a
# one-process checkpoint -> 2 and 3 ranks. A missing shard file, or one of another step or run,
# stays an error naming --load-model and the file.
# Run with -DFUSEKIT=<binary> -DCOMPARE=<checkpoint_compare> -DMPIEXEC=<mpirun> -DCONFIG=<configs/tiny_dcnv2.json>
# -DWORK=<scratch folder>.
file(REMOVE_RECURSE ${WORK})
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
# Row-wise Adagrad, the 2000-row tables split by rows (3 shards of at most 700).
set(model --config ${CONFIG} --print-every 10 --optimizer adagrad --learning-rate 0.05 --rowwise-adagrad)
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)

# train(NAME RANKS ARGS...): fusekit train into WORK/NAME/state.ckpt; RANKS 0: the one-process
# fusekit train, else --distributed under mpirun -np RANKS.
function(train name ranks)
  file(MAKE_DIRECTORY ${WORK}/${name})
  if(ranks EQUAL 0)
    run(${FUSEKIT} train ${model} --checkpoint ${WORK}/${name}/state.ckpt ${ARGN})
  else()
    run(${MPIEXEC} -np ${ranks} --oversubscribe ${FUSEKIT} train ${model} --distributed
        --checkpoint ${WORK}/${name}/state.ckpt ${ARGN})
  endif()
endfunction()
# continued(NAME RANKS FROM REFERENCE ARGS...): FROM's checkpoint continued to step 40 on RANKS,
# its state compared with REFERENCE's.
function(continued name ranks from reference)
  train(${name} ${ranks} --steps 40 --load-model ${WORK}/${from}/state.ckpt ${ARGN})
  if(name STREQUAL reference)
    return()
  endif()
  execute_process(COMMAND ${COMPARE} ${WORK}/${name}/state.ckpt ${WORK}/${reference}/state.ckpt
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${name}: ${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} (${from} continued on ${ranks} ranks) differs from ${reference}")
  endif()
endfunction()
# refused(RANKS FROM PATTERN): continuing FROM on RANKS fails with an error matching PATTERN.
function(refused ranks from pattern)
  file(MAKE_DIRECTORY ${WORK}/refused)
  execute_process(COMMAND ${MPIEXEC} -np ${ranks} --oversubscribe ${FUSEKIT} train ${model} --distributed --steps 40
                          --load-model ${WORK}/${from}/state.ckpt --checkpoint ${WORK}/refused/state.ckpt
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "continuing ${from} on ${ranks} ranks was not refused with ${pattern}: ${out}${err}")
  endif()
endfunction()

set(rows --max-shard-rows 700)
train(from2 2 --steps 20 ${rows})
continued(on2 2 from2 on2 ${rows})  # the reference: the ranks that saved it
continued(on4 4 from2 on2 ${rows})
continued(on1 1 from2 on2 ${rows})
continued(on2_resplit 2 from2 on2 --max-shard-rows 450)
continued(on2_whole 2 from2 on2)
continued(one_process 0 from2 on2)

train(from4 4 --steps 20 ${rows})
continued(from4_on4 4 from4 from4_on4 ${rows})
continued(from4_on2 2 from4 from4_on4 ${rows})
continued(from4_on3 3 from4 from4_on4 ${rows})

train(from0 0 --steps 20)
continued(from0_on0 0 from0 from0_on0)
continued(from0_on2 2 from0 from0_on0 ${rows})
continued(from0_on3 3 from0 from0_on0)

# A shard file of another step (step 40's, renamed), of another run (another model seed), missing.
file(COPY_FILE ${WORK}/on2/state.ckpt.step40.rank1-of-2 ${WORK}/from2/state.ckpt.step20.rank1-of-2)
refused(4 from2 "--load-model.*shard file of .*step 40")
train(other 2 --steps 20 ${rows} --seed 5)
file(COPY_FILE ${WORK}/other/state.ckpt.step20.rank1-of-2 ${WORK}/from2/state.ckpt.step20.rank1-of-2)
refused(3 from2 "--load-model.*shard file of .*config_crc")
file(REMOVE ${WORK}/from2/state.ckpt.step20.rank1-of-2)
refused(1 from2 "--load-model.*shard file of rank 1.*No such file")
message("distributed re-shard: every continued state within tolerance")
