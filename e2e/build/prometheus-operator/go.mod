// Not built: pins the Prometheus Operator module whose example/prometheus-operator-crd/ (the
// monitoring.coreos.com CRDs: PodMonitor and the rest) e2e/monitoring.py installs into the e2e cluster,
// read from this module's download (`go mod download`), so the CRDs are not copied into this repo.
module tensorfleet.dev/e2e/build/prometheus-operator

go 1.26.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
