// Command gitops-check judges InferenceService objects the way GitOps tools do, with their own code:
//
//	gitops-check kstatus < objects.json
//	    kstatus's Compute (sigs.k8s.io/cli-utils, what Flux's health checks run) on each object;
//	gitops-check argo-health SCRIPT.lua < objects.json
//	    an Argo CD resource health script in gopher-lua (the VM Argo CD embeds), with the object as the
//	    global `obj` the way Argo CD hands it over (JSON values as Lua values, arrays from index 1).
//
// It reads a JSON array of objects and writes a JSON array of {"status": ..., "message": ...}, one per object.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: gitops-check kstatus | argo-health SCRIPT.lua  (objects: a JSON array on stdin)")
	}
	var objects []json.RawMessage
	if err := json.NewDecoder(os.Stdin).Decode(&objects); err != nil {
		fail("stdin: " + err.Error())
	}
	var out []verdict
	switch os.Args[1] {
	case "kstatus":
		for _, raw := range objects {
			// As client-go decodes it: whole numbers as int64, which kstatus's accessors insist on.
			obj := &unstructured.Unstructured{}
			if err := obj.UnmarshalJSON(raw); err != nil {
				fail("stdin: " + err.Error())
			}
			result, err := status.Compute(obj)
			if err != nil {
				fail("kstatus: " + err.Error())
			}
			out = append(out, verdict{result.Status.String(), result.Message})
		}
	case "argo-health":
		if len(os.Args) != 3 {
			fail("usage: gitops-check argo-health SCRIPT.lua")
		}
		script, err := os.ReadFile(os.Args[2])
		if err != nil {
			fail(err.Error())
		}
		for _, raw := range objects {
			var obj map[string]interface{}
			if err := json.Unmarshal(raw, &obj); err != nil {
				fail("stdin: " + err.Error())
			}
			out = append(out, health(string(script), obj))
		}
	default:
		fail("unknown command " + os.Args[1])
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err.Error())
	}
}

// health runs SCRIPT with `obj` set, as Argo CD's Lua VM does, and reads the table it returns.
func health(script string, obj map[string]interface{}) verdict {
	vm := lua.NewState()
	defer vm.Close()
	vm.SetGlobal("obj", toLua(vm, obj))
	if err := vm.DoString(script); err != nil {
		fail("lua: " + err.Error())
	}
	returned, ok := vm.Get(-1).(*lua.LTable)
	if !ok {
		fail("lua: the script returned no table")
	}
	return verdict{lua.LVAsString(returned.RawGetString("status")), lua.LVAsString(returned.RawGetString("message"))}
}

// toLua converts a decoded JSON value: objects to tables by key, arrays to tables from index 1, null to nil.
func toLua(vm *lua.LState, value interface{}) lua.LValue {
	switch v := value.(type) {
	case nil:
		return lua.LNil
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []interface{}:
		table := vm.NewTable()
		for _, item := range v {
			table.Append(toLua(vm, item))
		}
		return table
	case map[string]interface{}:
		table := vm.NewTable()
		for key, item := range v {
			table.RawSetString(key, toLua(vm, item))
		}
		return table
	}
	fail(fmt.Sprintf("unexpected JSON value %T", value))
	return lua.LNil
}

func fail(message string) {
	fmt.Fprintln(os.Stderr, "gitops-check: "+message)
	os.Exit(1)
}
