# fusekit data synth -> gzip TSV -> fusekit data convert -> fusekit train on the binary file.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${FUSEKIT} data synth --rows 30000 --seed 5 --out ${WORK}/synthetic.tsv)
file(ARCHIVE_CREATE OUTPUT ${WORK}/synthetic.tsv.gz PATHS ${WORK}/synthetic.tsv FORMAT raw COMPRESSION GZip)
run(${FUSEKIT} data convert ${WORK}/synthetic.tsv.gz ${WORK}/synthetic.bin --strict)
run(${FUSEKIT} train --config ${CONFIG} --data ${WORK}/synthetic.bin --print-every 0)
