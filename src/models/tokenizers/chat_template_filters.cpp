// Jinja2's filters and tests on chat-template values (chat_template_values.h), as Jinja's
// defaults define them, with Transformers' `tojson` (json.dumps).

#include "chat_template_values.h"

namespace difftrain::models::jinja::values {

using namespace detail;

Value apply_filter(const std::string& name, const Value& v, const std::vector<Value>& args,
                   const Keywords& keywords) {
  if (name == "length" || name == "count") {
    if (v.kind == Value::Kind::kUndefined) return Value::data(int64_t{0});
    if (v.kind == Value::Kind::kData && v.json.is_string()) {
      return Value::data(static_cast<int64_t>(chars(v.json.get_ref<const std::string&>()).size()));
    }
    if (v.kind == Value::Kind::kData && (v.json.is_array() || v.json.is_object())) {
      return Value::data(static_cast<int64_t>(v.json.size()));
    }
    throw TypeError("object of type '" + type_name(v) + "' has no len()");
  }
  if (name == "tojson") {
    const Value* ascii = arg(args, keywords, 0, "ensure_ascii");
    const int64_t indent = int_arg(arg(args, keywords, 1, "indent"), -1, "tojson's indent");
    const Value* separators = arg(args, keywords, 2, "separators");
    const Value* sort = arg(args, keywords, 3, "sort_keys");
    std::string item_sep = indent >= 0 ? "," : ", ";
    std::string key_sep = ": ";
    if (separators != nullptr && separators->kind == Value::Kind::kData &&
        separators->json.is_array() && separators->json.size() == 2) {
      item_sep = separators->json[0].get<std::string>();
      key_sep = separators->json[1].get<std::string>();
    }
    return Value::data(json_dumps(to_json(v), ascii != nullptr && truthy(*ascii),
                                  static_cast<int>(indent), item_sep, key_sep,
                                  sort != nullptr && truthy(*sort)));
  }
  if (name == "trim")
    return Value::data(strip(to_str(v), arg(args, keywords, 0, "chars"), true, true));
  if (name == "upper" || name == "lower")
    return Value::data(ascii_case(to_str(v), name == "upper"));
  if (name == "title") return Value::data(title(to_str(v)));
  if (name == "capitalize") return call_method(Value::data(to_str(v)), "capitalize", {}, {});
  if (name == "default" || name == "d") {
    const Value* fallback = arg(args, keywords, 0, "default_value");
    const Value* boolean = arg(args, keywords, 1, "boolean");
    const bool use =
        v.kind == Value::Kind::kUndefined || (boolean != nullptr && truthy(*boolean) && !truthy(v));
    if (use) return fallback != nullptr ? *fallback : Value::data("");
    return v;
  }
  if (name == "first" || name == "last") {
    const auto items = iterate(v);
    if (items.empty()) return Value::undefined("no " + name + " item, the sequence was empty");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    const Value* sep = arg(args, keywords, 0, "d");
    const Value* attribute = arg(args, keywords, 1, "attribute");
    std::string out;
    bool first = true;
    for (const auto& item : iterate(v)) {
      out += (first ? "" : (sep != nullptr ? to_str(*sep) : "")) +
             to_str(attribute != nullptr ? get_attr(item, to_str(*attribute)) : item);
      first = false;
    }
    return Value::data(out);
  }
  if (name == "list") {
    Json out = Json::array();
    for (const auto& item : iterate(v)) out.push_back(to_json(item));
    return Value::data(out);
  }
  if (name == "string") return Value::data(to_str(v));
  if (name == "safe") return v;
  if (name == "int" || name == "float") {
    const bool want_int = name == "int";
    const Value* fallback = arg(args, keywords, 0, "default");
    Json result;
    if (v.kind == Value::Kind::kData && is_number(v.json)) {
      result = want_int ? Json(static_cast<int64_t>(as_double(v.json))) : Json(as_double(v.json));
    } else if (v.kind == Value::Kind::kData && v.json.is_string()) {
      const std::string s = strip(v.json.get<std::string>(), nullptr, true, true);
      char* end = nullptr;
      const double x = std::strtod(s.c_str(), &end);
      if (!s.empty() && end == s.c_str() + s.size()) {
        result = want_int ? Json(static_cast<int64_t>(x)) : Json(x);
      }
    }
    if (result.is_null())
      return fallback != nullptr ? *fallback
                                 : (want_int ? Value::data(int64_t{0}) : Value::data(0.0));
    return Value::data(result);
  }
  if (name == "abs")
    return negate(v, v.kind == Value::Kind::kData && is_number(v.json) && as_double(v.json) < 0);
  if (name == "items") {
    if (v.kind == Value::Kind::kUndefined) return Value::data(Json::array());
    return call_method(v, "items", {}, {});
  }
  if (name == "reverse") {
    const Value step = Value::data(int64_t{-1});
    return slice(v, Value(), Value(), step);
  }
  if (name == "replace") {
    return call_method(Value::data(to_str(v)), "replace", args, keywords);
  }
  if (name == "selectattr" || name == "rejectattr") {
    if (args.empty()) throw TypeError(name + " needs an attribute name");
    const std::string attribute = to_str(args[0]);
    const std::string test = args.size() > 1 ? to_str(args[1]) : "";
    const std::vector<Value> test_args(args.size() > 2 ? args.begin() + 2 : args.end(), args.end());
    Json out = Json::array();
    for (const auto& item : iterate(v)) {
      const Value value = get_attr(item, attribute);
      const bool pass = test.empty() ? truthy(value) : apply_test(test, value, test_args);
      if (pass == (name == "selectattr")) out.push_back(to_json(item));
    }
    return Value::data(out);
  }
  if (name == "map") {
    const Value* attribute = arg(args, keywords, 99, "attribute");
    Json out = Json::array();
    for (const auto& item : iterate(v)) {
      if (attribute != nullptr) {
        Value value = get_attr(item, to_str(*attribute));
        if (value.kind == Value::Kind::kUndefined) {
          const Value* d = arg({}, keywords, 0, "default");
          if (d != nullptr) value = *d;
        }
        out.push_back(to_json(value));
      } else {
        if (args.empty()) throw TypeError("map needs a filter name or attribute=");
        const std::vector<Value> rest(args.begin() + 1, args.end());
        out.push_back(to_json(apply_filter(to_str(args[0]), item, rest, {})));
      }
    }
    return Value::data(out);
  }
  throw TypeError("no filter named '" + name + "' in difftrain's chat templates");
}

bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args) {
  const bool data = v.kind == Value::Kind::kData;
  const Json& j = v.json;
  if (name == "defined") return v.kind != Value::Kind::kUndefined;
  if (name == "undefined") return v.kind == Value::Kind::kUndefined;
  if (name == "none") return data && j.is_null();
  if (name == "string") return data && j.is_string();
  if (name == "number") return data && is_number(j);
  if (name == "integer") return data && j.is_number_integer();
  if (name == "float") return data && j.is_number_float();
  if (name == "boolean") return data && j.is_boolean();
  if (name == "true") return data && j.is_boolean() && j.get<bool>();
  if (name == "false") return data && j.is_boolean() && !j.get<bool>();
  if (name == "mapping") return data && j.is_object();
  if (name == "iterable")
    return v.kind == Value::Kind::kUndefined ||
           (data && (j.is_array() || j.is_object() || j.is_string()));
  if (name == "sequence") return data && (j.is_array() || j.is_object() || j.is_string());
  if (name == "callable") return false;
  if (name == "odd" || name == "even") {
    if (!data || !is_int(j))
      throw TypeError("the " + name + " test needs an integer, not " + type_name(v));
    return (as_int(j) % 2 != 0) == (name == "odd");
  }
  if (args.empty()) throw TypeError("no test named '" + name + "' (or it needs an argument)");
  const Value& other = args[0];
  if (name == "divisibleby") {
    const int64_t d = int_arg(&other, 1, "divisibleby's argument");
    if (d == 0) throw TypeError("integer division or modulo by zero");
    return int_arg(&v, 0, "divisibleby's value") % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, other);
  if (name == "ne" || name == "!=") return !equals(v, other);
  if (name == "lt" || name == "lessthan" || name == "<") return compare("<", v, other);
  if (name == "le" || name == "<=") return compare("<=", v, other);
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(">", v, other);
  if (name == "ge" || name == ">=") return compare(">=", v, other);
  if (name == "in") return contains(other, v);
  if (name == "sameas") {
    if (!data || other.kind != Value::Kind::kData) return v.kind == other.kind && v.ns == other.ns;
    return j.type() == other.json.type() && j == other.json;
  }
  throw TypeError("no test named '" + name + "' in difftrain's chat templates");
}

}  // namespace difftrain::models::jinja::values
