#!/bin/sh
# Creates the buckets and one MinIO user per service, each allowed its own bucket only:
#   MINIO_MLFLOW_USER    -> s3://mlflow (the MLflow server's artifact store)
#   MINIO_PIPELINE_USER  -> s3://data   (the Prefect worker and the Ray nodes)
# The root credentials reach mc through MC_HOST_local (an environment variable), never argv.
set -eu
: "${MC_HOST_local:?MC_HOST_local is not set}"
policy_dir=$(mktemp -d)
for pair in "mlflow:MINIO_MLFLOW" "data:MINIO_PIPELINE"; do
    bucket=${pair%%:*}
    prefix=${pair#*:}
    eval "user=\${${prefix}_USER:?${prefix}_USER is not set}"
    eval "password=\${${prefix}_PASSWORD:?${prefix}_PASSWORD is not set}"
    mc mb --ignore-existing "local/$bucket"
    cat > "$policy_dir/$bucket.json" <<JSON
{"Version": "2012-10-17", "Statement": [
  {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"],
   "Resource": ["arn:aws:s3:::$bucket"]},
  {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
   "s3:ListMultipartUploadParts"], "Resource": ["arn:aws:s3:::$bucket/*"]}]}
JSON
    mc admin policy create local "$bucket-rw" "$policy_dir/$bucket.json"
    # mc takes the new user's secret as an argument: it exists for this one-shot command only.
    mc admin user add local "$user" "$password"
    mc admin policy attach local "$bucket-rw" --user "$user" || true  # already attached on a rerun
done
rm -rf "$policy_dir"
echo "minio-init: buckets mlflow and data, users $MINIO_MLFLOW_USER and $MINIO_PIPELINE_USER"
