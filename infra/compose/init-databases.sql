-- One Postgres, two databases: Prefect's and MLflow's metadata.
CREATE DATABASE prefect;
CREATE DATABASE mlflow;
