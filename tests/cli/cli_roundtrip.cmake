# fusekit data synth -> gzip TSV -> fusekit data convert -> fusekit train on the binary file.
# Run with -DFUSEKIT=<binary> -DCONFIG=<configs/tiny.json> -DWORK=<scratch folder>.
file(MAKE_DIRECTORY ${WORK})
include(${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake)
run(${FUSEKIT} data synth --rows 30000 --seed 5 --out ${WORK}/synthetic.tsv)
file(ARCHIVE_CREATE OUTPUT ${WORK}/synthetic.tsv.gz PATHS ${WORK}/synthetic.tsv FORMAT raw COMPRESSION GZip)
run(${FUSEKIT} data convert ${WORK}/synthetic.tsv.gz ${WORK}/synthetic.bin --strict)
run(${FUSEKIT} train --config ${CONFIG} --data ${WORK}/synthetic.bin --print-every 0)
