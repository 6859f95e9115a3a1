# fusekit train --distributed when one rank goes wrong: every rank ends, within a time limit,
# with a non-zero status and a message naming what went wrong, never a hang.
#   - a rank that fails (its shard file of a checkpoint corrupted: only rank 1 reads it): it prints
#     its error and aborts every rank (MPI_Abort);
#   - a rank killed (SIGKILL, no chance to say anything): mpirun ends the others.
# Run with -DFUSEKIT=<binary> -DMPIEXEC=<mpirun> -DCONFIG=<configs/tiny_dcnv2.json> -DWORK=<scratch folder>.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
set(mpi ${MPIEXEC} -np 2 --oversubscribe ${FUSEKIT})
set(common train --config ${CONFIG} --distributed --print-every 0)
set(limit 60)  # seconds; a hang would be the test's timeout

execute_process(COMMAND ${mpi} ${common} --steps 10 --checkpoint ${WORK}/state.ckpt
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the 2-rank run failed (${rc}): ${out}${err}")
endif()

# A failing rank: rank 1's shard file with a byte flipped in its middle.
set(shard ${WORK}/state.ckpt.step10.rank1-of-2)
file(SIZE ${shard} size)
math(EXPR mid "${size} / 2")
# The byte b at the middle becomes 255 - b (never b).
execute_process(COMMAND bash -c "b=$(od -An -tu1 -j ${mid} -N1 '${shard}'); printf \"\\\\$(printf %o $((255 - b)))\" | dd of='${shard}' bs=1 seek=${mid} conv=notrunc status=none"
                RESULT_VARIABLE rc)
file(SIZE ${shard} after)
if(NOT rc EQUAL 0 OR NOT after EQUAL size)
  message(FATAL_ERROR "could not damage ${shard} (${rc})")
endif()
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${mpi} ${common} --steps 20 --checkpoint ${WORK}/state.ckpt --resume
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${limit})
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
if(rc EQUAL 0 OR "${rc}" MATCHES "timeout" OR NOT "${err}" MATCHES "rank 1.*state\\.ckpt\\.step10\\.rank1-of-2")
  message(FATAL_ERROR "a rank failing to read its shard file did not end the run with its error "
                      "(status ${rc} after ${took} s): ${out}${err}")
endif()
message("failing rank: every rank ended after ${took} s (status ${rc})")

# A killed rank: rank 1 (mpirun's last child) gets SIGKILL once both ranks are training.
string(JOIN " " common_args ${common})
execute_process(COMMAND bash -c "
  ${MPIEXEC} -np 2 --oversubscribe ${FUSEKIT} ${common_args} --train-samples 100000000 > '${WORK}/killed.log' 2>&1 &
  mp=$!
  for i in $(seq 600); do
    [ $(pgrep -P $mp | wc -l) -ge 2 ] && grep -q 'sharding plan' '${WORK}/killed.log' && break
    sleep 0.1
  done
  sleep 1
  kill -9 $(pgrep -P $mp | tail -1)
  for i in $(seq $((${limit} * 10))); do kill -0 $mp 2>/dev/null || break; sleep 0.1; done
  if kill -0 $mp 2>/dev/null; then kill -9 $mp; echo 'mpirun still running after ${limit} s'; exit 3; fi
  wait $mp; echo \"mpirun status $?\"; cat '${WORK}/killed.log'"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT "${out}" MATCHES "mpirun status [1-9]" OR NOT "${out}" MATCHES "rank 1 .*signal 9")
  message(FATAL_ERROR "a killed rank did not end the run (status ${rc}): ${out}${err}")
endif()
message("killed rank: mpirun ended every rank and named rank 1")
message("rank failures: every rank ended with an error")
