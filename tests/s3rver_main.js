// Start s3rver (npm) on 127.0.0.1: node s3rver_main.js MODULES_DIR PORT DATA_DIR BUCKET; prints "ready" once it listens.
const S3rver = require(require('path').join(process.argv[2], 's3rver'));
const [port, directory, bucket] = [Number(process.argv[3]), process.argv[4], process.argv[5]];
new S3rver({ port, address: '127.0.0.1', silent: true, directory, configureBuckets: [{ name: bucket, configs: [] }] })
  .run()
  .then(() => console.log('ready'), (err) => { console.error(err.message); process.exit(1); });
